"""SGLang 0.5.23's own HTTP layer, in-process, for the contract tests (needs the real sglang package).

`SGLangHTTP(model_dir, context_length)` serves every route of `sglang.srt.entrypoints.http_server.app` with
the same path, methods and endpoint signature, and the app's own exception handlers, so FastAPI parses bodies
and query parameters into SGLang's request classes exactly as the real server does (a parse error is the
real HTTP 400). Where the real endpoint hands the request to the TokenizerManager, these endpoints run the
real TokenizerManager's request checks instead of a scheduler: for /generate the contract gate
(`generate_contract_error`), `GenerateReqInput.normalize_batch_and_arguments`, and per request
`TokenizerManager._tokenize_one_request` (the context-length checks, `SamplingParams(**...)`,
`.normalize(None)` as under --skip-tokenizer-init, `.verify(vocab_size)`) and the scheduler's input-length check
(`validate_input_length`, with its limit context_len - 6 as tp_worker derives it), with the ServerArgs of a real
`--skip-tokenizer-init --device cpu` launch published and the model config read from `model_dir`. Every other
route answers 200 once its body and query parsed. Nothing here decides an outcome of its own."""
from __future__ import annotations

import asyncio
import inspect
import typing
import warnings


class _TimeStats:  # the per-request timing record the real _init_req_state would create
    def set_tokenize_finish_time(self):
        pass


class _States(dict):
    def __missing__(self, rid):
        from types import SimpleNamespace

        return SimpleNamespace(time_stats=_TimeStats())


def tokenizer_manager(model_dir: str, context_length: int | None, extra_args: tuple[str, ...] = ()):
    """A real TokenizerManager's request checks for a --skip-tokenizer-init server of `model_dir` (no scheduler,
    no ZMQ): ServerArgs from SGLang's own parser and resolution, published as in the server process."""
    warnings.filterwarnings("ignore")
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.managers.utils import compute_num_reserved_tokens
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_disagg, get_lora, get_serving, publish
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", model_dir, "--skip-tokenizer-init", "--device", "cpu", *extra_args]
    if context_length:
        argv += ["--context-length", str(context_length)]
    server_args = prepare_server_args(argv)
    publish(server_args, role="tokenizer")
    tm = object.__new__(TokenizerManager)
    tm.server_args = server_args
    tm.model_config = ModelConfig.from_server_args(server_args)
    tm.context_len = tm.model_config.context_len
    tm.allow_auto_truncate = get_serving().allow_auto_truncate
    tm.skip_tokenizer_init = True
    tm.num_reserved_tokens = compute_num_reserved_tokens()
    tm.validate_total_tokens = True
    tm.is_generation = True
    tm.tokenizer = tm.processor = tm.mm_processor = None
    tm.max_req_input_len = None
    tm.preferred_sampling_params = None
    tm.sampling_params_class = SamplingParams
    tm.tokenized_generate_req_type = TokenizedGenerateReqInput
    tm.fake_bootstrap_room_counter = 0
    tm.rid_to_state = _States()
    # what the output path reads, set as TokenizerManager.__init__ sets it for this launch
    tm.disaggregation_mode = DisaggregationMode(get_disagg().disaggregation_mode)
    tm.enable_lora = get_lora().enable_lora
    tm.enable_metrics = tm.enable_trace = tm.incremental_streaming_output = False
    tm.dump_requests_folder = tm.crash_dump_folder = None
    return tm


class SGLangHTTP:
    def __init__(self, model_dir: str, context_length: int | None = None, extra_args: tuple[str, ...] = ()):
        warnings.filterwarnings("ignore")
        from fastapi import FastAPI
        from fastapi.routing import APIRoute
        from fastapi.testclient import TestClient
        from sglang.srt.entrypoints import http_server

        self.tm = tokenizer_manager(model_dir, context_length, extra_args)
        # the scheduler's limit with a KV pool larger than the context (managers/tp_worker.py)
        self.max_req_input_len = (self.tm.context_len - 1) - 5
        self.real = http_server
        app = FastAPI()
        for exc, handler in http_server.app.exception_handlers.items():
            app.add_exception_handler(exc, handler)
        self.routes: dict[str, set[str]] = {}
        for r in http_server.app.routes:
            if isinstance(r, APIRoute):
                app.router.add_api_route(r.path, self._endpoint(r), methods=sorted(r.methods))
                self.routes.setdefault(r.path, set()).update(r.methods)
        self.client = TestClient(app, raise_server_exceptions=True)

    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None) -> tuple[int, str]:
        from sglang.srt.runtime_context import publish

        publish(self.tm.server_args, role="tokenizer")  # this launch's config (another instance may have published)
        if raw is not None:
            r = self.client.request(method, path, content=raw, headers={"Content-Type": "application/json"})
        else:
            r = self.client.request(method, path, json=body)
        return r.status_code, r.text

    def _endpoint(self, route):
        from fastapi import Request

        real = route.endpoint
        hints = typing.get_type_hints(real, include_extras=True)
        params = [p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
                  for p in inspect.signature(real).parameters.values()]
        if not any(p.annotation is Request for p in params):
            params.append(inspect.Parameter("_request", inspect.Parameter.KEYWORD_ONLY, annotation=Request))
        path = route.path

        async def endpoint(**kwargs):
            request = next(v for v in kwargs.values() if isinstance(v, Request))
            if path == "/generate":
                return await self._generate(kwargs["obj"], request)
            from fastapi.responses import ORJSONResponse

            return ORJSONResponse({"success": True, "message": "parsed"})

        endpoint.__signature__ = inspect.Signature(params)
        endpoint.__name__ = real.__name__
        return endpoint

    async def _generate(self, obj, request):
        """The real /generate route up to the scheduler: the contract gate, then the TokenizerManager's
        normalisation and per-request checks; errors are answered by the route's own error builder."""
        from types import SimpleNamespace

        from fastapi.responses import ORJSONResponse
        from sglang.srt.managers.utils import validate_input_length

        error = self.real.generate_contract_error(await request.json())
        if error is not None:
            return ORJSONResponse(status_code=400, content={"error": error})
        try:
            obj.normalize_batch_and_arguments()
            subs = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
            tokenized = [await self.tm._tokenize_one_request(sub) for sub in subs]
            for t in tokenized:  # the scheduler's own input check (an abort with HTTP 400 there)
                req = SimpleNamespace(origin_input_ids=list(t.input_ids))
                error = validate_input_length(req, self.max_req_input_len, self.tm.allow_auto_truncate)
                if error:
                    raise ValueError(error)
        except ValueError as e:
            return self.real._create_error_response(e)
        return ORJSONResponse({"tokenized": [{"input_ids": list(t.input_ids),
                                              "max_new_tokens": t.sampling_params.max_new_tokens,
                                              "sampling_seed": t.sampling_params.sampling_seed}
                                             for t in tokenized]})


def run(coro):
    return asyncio.run(coro)
