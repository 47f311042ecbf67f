"""R3 refuses SGLang servers running expert-location dispatch (EPLB, redundant experts, a non-trivial initial
placement, elastic backups): their recorded expert ids are physical slots, not the model's experts. Checked on
the flags the launcher would pass and on servers given by rollout.urls (their /get_server_info)."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf

from m2po_megatron.rollout.server_spec import ServerSpec, build_command

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("extra, named", [
    (("--enable-eplb",), "enable_eplb=True"),
    (("--ep-num-redundant-experts", "32"), "ep_num_redundant_experts=32"),
    (("--init-expert-location=/plans/placement.json",), "init_expert_location=/plans/placement.json"),
    (("--enable-elastic-expert-backup",), "enable_elastic_expert_backup=True"),
])
def test_launching_sglang_for_r3_refuses_expert_location_dispatch(extra, named):
    spec = ServerSpec(model_path="/models/moe", engine="sglang", enable_return_routed_experts=True,
                      extra_args=("--tp-size", "2") + extra)
    with pytest.raises(ValueError, match=rf"algo.routing_replay = r3 with extra_args running expert-location "
                                         rf"dispatch \({named}\): SGLang then records physical expert slots"):
        build_command(spec)
    assert build_command(ServerSpec(model_path="/models/moe", engine="sglang", extra_args=extra))[-len(extra):] \
        == list(extra)  # without R3 the ids do not matter: SGLang's own business


def test_the_identity_placement_is_accepted_under_r3():
    extra = ("--ep-num-redundant-experts", "0", "--init-expert-location", "trivial")
    cmd = build_command(ServerSpec(model_path="/models/moe", engine="sglang", enable_return_routed_experts=True,
                                   extra_args=extra))
    assert cmd[-4:] == list(extra) and "--enable-return-routed-experts" in cmd


class FakeSGLang:
    """Answers /health_generate and /get_server_info as an SGLang 0.5.23 server started with `server_args`."""

    def __init__(self, server_args: dict):
        info = json.dumps({"tp_size": 1, "dp_size": 1, "enable_eplb": False, "ep_num_redundant_experts": 0,
                           "init_expert_location": "trivial", **server_args}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = info if self.path == "/get_server_info" else b"{}"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_attached_servers_with_eplb_are_refused_under_r3_only(tmp_path):
    from transformers import Qwen3MoeConfig

    from m2po_megatron.config import ConfigError
    from m2po_megatron.run.servers import start_rollout_engines

    Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, hidden_size=64,
                   num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32).save_pretrained(tmp_path)
    plain, eplb = FakeSGLang({}), FakeSGLang({"enable_eplb": True, "ep_num_redundant_experts": 32})
    try:
        def cfg(mode):
            return OmegaConf.create({"algo": {"routing_replay": mode}, "model": {"hf_path": str(tmp_path)},
                                     "rollout": {"urls": [plain.url, eplb.url], "api_key": None,
                                                 "health_timeout_s": 10}})
        with pytest.raises(ConfigError) as e:
            start_rollout_engines(cfg("r3"), tmp_path)
        msg = str(e.value)
        assert f"{eplb.url}: enable_eplb=True, ep_num_redundant_experts=32" in msg and plain.url not in msg
        assert "rollout.urls" in msg and "algo.routing_replay = r2 or none" in msg
        assert start_rollout_engines(cfg("r2"), tmp_path) == (None, [plain.url, eplb.url])
    finally:
        plain.close()
        eplb.close()
