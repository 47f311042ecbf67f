"""Fetching a model's HF weights from the Hugging Face hub into the directory a recipe reads (`model.hf_path`),
then checking them (models/check.py). huggingface_hub does the transfer: HF_TOKEN (gated models such as Llama),
HF_HOME and HF_ENDPOINT (a mirror) apply as for any HF tool, and an interrupted download resumes."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

from m2po_megatron.models.check import WeightsError, weight_problems

# What the trainer, the converter and SGLang read: the config, the tokenizer, the safetensors shards with their
# index and the generation defaults. Not *.bin/*.pth duplicates, original/ (Meta's consolidated checkpoint) or
# other repository files, which would double the download of some models.
ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                  "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json"]

BUNDLED_CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"

# huggingface_hub writes its per-file metadata here inside a download directory (its `local_dir` mode): the
# mark of a directory this command started, which it may therefore complete.
DOWNLOAD_MARK = os.path.join(".cache", "huggingface")


def hf_id_from_config_path(path: Optional[str]) -> Optional[str]:
    """Qwen/Qwen3-8B-Base from .../assets/configs/Qwen__Qwen3-8B-Base/config.json (the bundled configs are named
    after their hub repo, `/` written `__`), else None."""
    if not path:
        return None
    p = Path(path)
    name = (p.parent if p.name == "config.json" else p).name
    org, sep, repo = name.partition("__")
    return f"{org}/{repo}" if sep and org and repo else None


def bundled_config(hf_id: str) -> Optional[Path]:
    """The shipped config.json of a hub repo, if the package has one."""
    p = BUNDLED_CONFIGS / hf_id.replace("/", "__", 1) / "config.json"
    return p if p.is_file() else None


def describe(problems: list[str]) -> str:
    return "; ".join(problems)


def fetch(hf_id: str, target: str, *, revision: Optional[str] = None, reference: Any = None,
          log: Callable[[str], None] = print) -> str:
    """Make `target` a complete, checked copy of hub repo `hf_id` (at `revision`, default main) and return
    'verified' (it already was: nothing downloaded) or 'downloaded'. `reference` is the config the recipe was
    planned for (checked against the downloaded config.json). Raises WeightsError naming the problem and fix."""
    if os.path.isdir(target) and os.listdir(target):
        problems = weight_problems(target, reference)
        if not problems:
            log(f"{target}: complete ({hf_id} weights, config and tokenizer check out); nothing to download")
            return "verified"
        if not os.path.isdir(os.path.join(target, DOWNLOAD_MARK)):
            # someone else's directory (a converted or hand-copied model): never overwrite its files
            raise WeightsError(f"{target} exists, was not written by `m2po download`, and is not a complete copy "
                               f"of {hf_id}: {describe(problems)}. Move it away (or point model.hf_path elsewhere) "
                               f"and run the command again")
        log(f"{target}: incomplete ({describe(problems)}); resuming the download")
    _download(hf_id, target, revision)
    problems = weight_problems(target, reference)
    if problems:
        raise WeightsError(f"downloaded {hf_id} into {target}, but {describe(problems)}. If the recipe's "
                           f"model.hf_id or model.hf_config names another model, fix the recipe; otherwise "
                           f"delete {target} and download again")
    log(f"{target}: downloaded {hf_id}; weights, config and tokenizer check out")
    return "downloaded"


def _download(hf_id: str, target: str, revision: Optional[str]) -> None:
    import huggingface_hub
    from huggingface_hub import constants, errors

    if constants.is_offline_mode():
        raise WeightsError(f"HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so {hf_id} cannot be downloaded into "
                           f"{target}; unset it on a machine that reaches the hub (or HF_ENDPOINT's mirror)")
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not at huggingface_hub's import
    where = endpoint or constants.ENDPOINT
    try:
        huggingface_hub.snapshot_download(hf_id, revision=revision, local_dir=target, allow_patterns=ALLOW_PATTERNS,
                                          endpoint=endpoint)
    except errors.GatedRepoError:
        raise WeightsError(f"{hf_id} is gated on {where}: accept its license on the model's page, then set HF_TOKEN "
                           f"to a token of that account (or `hf auth login`)") from None
    except errors.RepositoryNotFoundError:
        raise WeightsError(f"{hf_id} was not found on {where} (or is private): check model.hf_id, and set HF_TOKEN "
                           f"for a private repository") from None
    except errors.RevisionNotFoundError:
        raise WeightsError(f"{hf_id} has no revision {revision!r} on {where}; give an existing branch, tag or "
                           f"commit with --revision") from None
    except errors.LocalEntryNotFoundError as e:  # the hub could not be reached (it says why in its cause)
        cause = e.__cause__ or e
        raise WeightsError(f"cannot reach {where} to download {hf_id} ({type(cause).__name__}: {cause}); check the "
                           f"network, or set HF_ENDPOINT to a reachable mirror") from None
    except errors.HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0]
        raise WeightsError(f"downloading {hf_id} from {where} failed: {first}") from None
