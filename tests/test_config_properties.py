"""Property-based tests of the config loader (hypothesis): thousands of generated configs.

Every invalid config raises ConfigError (never a raw KeyError/TypeError/torch error), and
every valid one round-trips through YAML unchanged.  Examples per test come from the
hypothesis profile (tests/conftest.py): 800 by default (2,400 configs), 10,000 with
``HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_bridge import BridgeConfig, ConfigError

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]
DTYPES = ["fp32", "bf16", "fp16", "float32", "bfloat16", "float16", None]

valid_values: dict[str, st.SearchStrategy[Any]] = {
    "strategy": st.sampled_from(STRATEGIES + [s.upper() for s in STRATEGIES]),
    "backend": st.sampled_from(["fsdp1", "fsdp2", "FSDP1", "FSDP2"]),
    "mixed_precision": st.one_of(
        st.sampled_from(["fp32", "bf16", "fp16"]),
        st.fixed_dictionaries(
            {},
            optional={
                "param_dtype": st.sampled_from(DTYPES),
                "reduce_dtype": st.sampled_from(DTYPES),
                "output_dtype": st.sampled_from(DTYPES),
                "buffer_dtype": st.sampled_from(DTYPES),
                "cast_forward_inputs": st.booleans(),
            },
        ),
    ),
    "wrap": st.one_of(
        st.sampled_from(["auto", "none"]),
        st.lists(st.sampled_from(["LlamaDecoderLayer", "GPT2Block", "T5Block"]), min_size=1, max_size=3, unique=True),
        st.builds(lambda n: {"min_num_params": n}, st.integers(1, 10**9)),
    ),
    "backward_prefetch": st.sampled_from(["pre", "post", "none"]),
    "forward_prefetch": st.booleans(),
    "limit_all_gathers": st.booleans(),
    "cpu_offload": st.booleans(),
    "activation_checkpointing": st.booleans(),
    "sync_module_states": st.booleans(),
    "reshard_after_forward": st.one_of(st.none(), st.booleans(), st.integers(1, 64)),
    "ignored_modules": st.lists(st.sampled_from(["lm_head", "model.embed_tokens", "LlamaRMSNorm"]), unique=True),
    "device": st.sampled_from(["auto", "cpu", "cuda"]),
}
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _maybe_valid(data: dict[str, Any]) -> BridgeConfig | None:
    try:
        return BridgeConfig.from_dict(data)
    except ConfigError:
        return None


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries({}, optional=valid_values),
    st.one_of(st.none(), st.tuples(st.integers(1, 8), st.integers(1, 8))),
)
def test_valid_configs_round_trip_through_yaml(data: dict[str, Any], shape: tuple[int, int] | None) -> None:
    if shape is not None and str(data.get("strategy", "")).lower().startswith("hybrid"):
        data["hybrid_shape"] = list(shape)
    config = _maybe_valid(data)
    if config is None:
        # The only generated combinations that may be refused are the backend's unsupported ones.
        with_fsdp_ok = {**data, "backend": "fsdp2" if str(data.get("backend", "fsdp2")).lower() == "fsdp1" else "fsdp1"}
        assert _maybe_valid(with_fsdp_ok) is not None or "reshard_after_forward" in data
        return
    text = config.to_yaml()
    assert BridgeConfig.from_dict(yaml.safe_load(text)) == config
    assert BridgeConfig.from_dict(yaml.safe_load(text)).to_yaml() == text


@settings(deadline=None)
@given(
    st.dictionaries(
        st.one_of(st.sampled_from(sorted(valid_values)), st.text(min_size=1, max_size=10)),
        junk,
        min_size=1,
        max_size=6,
    )
)
def test_invalid_configs_raise_config_error_only(data: dict[str, Any]) -> None:
    try:
        BridgeConfig.from_dict(data)
    except ConfigError as err:
        assert err.problems, "a ConfigError must name at least one problem"
        for problem in err.problems:
            assert problem.key and problem.allowed, problem
    # Any other exception type propagates and fails the test.


@settings(deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_yaml_text_never_escapes_config_error(text: str) -> None:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return
    try:
        BridgeConfig.from_dict(data)
    except ConfigError:
        pass
