"""The engine flags the operator renders from the spec, per engine type (builders/engine.py,
builders/sglang_pd.py). A role's extra args must not set them again: the engines take the last
of a repeated flag, so `--tensor-parallel-size=64` after the operator's own value would win
and fail in the pod. The CRD refuses them (models.py turns this table into a CEL rule), and
tests/unit/operator/test_validate.py checks that every flag the builders render is here."""

from __future__ import annotations

OWNED_FLAGS: dict[str, tuple[str, ...]] = {
    # vLLM's parser also reads --a_b as --a-b and -tp as --tensor-parallel-size.
    "vllm-tpu": ("--model", "--port", "--served-model-name", "--tensor-parallel-size", "-tp",
                 "--kv-transfer-config", "--kv-events-config", "--revision", "--max-model-len"),
    "reference": ("--role", "--host", "--port", "--model", "--served-model-name", "--control-socket",
                  "--data-address", "--kv-events-endpoint", "--kv-events-topic", "--num-processes", "--process-id",
                  "--coordinator"),
    "sglang-jax": ("--model-path", "--host", "--port", "--served-model-name", "--tp-size",
                   "--tensor-parallel-size", "--revision", "--page-size", "--disaggregation-mode",
                   "--disaggregation-bootstrap-url", "--disaggregation-transfer-port",
                   "--disaggregation-side-channel-port", "--disaggregation-host-ip"),
}


def flag_pattern(engine: str) -> str:
    """An RE2 pattern matching an argument that sets one of the engine's owned flags, as
    `--flag`, `--flag=value`, or with underscores for dashes."""
    names = sorted({f.lstrip("-").replace("-", "[-_]") for f in OWNED_FLAGS[engine]})
    return f"^--?({'|'.join(names)})(=.*)?$"
