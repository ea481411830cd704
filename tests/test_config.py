"""Option validation: every bad input fails at compile time with a message that says how to fix it."""

import pytest
import torch

from piecewise_backend import DEFAULT_SPLITTING_OPS, PiecewiseConfig


def test_defaults_cover_sdpa():
    cfg = PiecewiseConfig.from_options(None)
    assert "aten::scaled_dot_product_attention" in cfg.all_splitting_ops
    assert cfg.cudagraphs and cfg.clone_outputs and cfg.warmup_runs == 1


def test_unknown_key_lists_accepted_options():
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'cuda_graphs'.*Accepted options: .*cudagraphs"):
        PiecewiseConfig.from_options({"cuda_graphs": False})


def test_an_unknown_key_close_to_an_option_names_it():
    with pytest.raises(ValueError, match=r"Did you mean 'capture_sizes' for 'capture_size'\?"):
        PiecewiseConfig.from_options({"capture_size": [1, 2]})
    with pytest.raises(ValueError) as raised:
        PiecewiseConfig.from_options({"zzz": 1})
    assert "Did you mean" not in str(raised.value)


@pytest.mark.parametrize("key,value", [("cudagraphs", 1), ("clone_outputs", "no")])
def test_bool_options_reject_non_bools(key, value):
    with pytest.raises(TypeError, match=f"'{key}' must be True or False"):
        PiecewiseConfig.from_options({key: value})


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_warmup_runs_must_be_non_negative_int(value):
    with pytest.raises(ValueError, match="'warmup_runs' must be an int >= 0"):
        PiecewiseConfig.from_options({"warmup_runs": value})


def test_splitting_ops_must_be_a_list():
    with pytest.raises(TypeError, match="must be a list of op names"):
        PiecewiseConfig.from_options({"splitting_ops": "aten::scaled_dot_product_attention"})


def test_op_name_needs_namespace():
    with pytest.raises(ValueError, match="not an op name.*'namespace::op'"):
        PiecewiseConfig.from_options({"extra_splitting_ops": ["paged_attention"]})


def test_unregistered_op_is_rejected_with_defaults_listed():
    with pytest.raises(ValueError, match="no op named 'nolib::nothing' is registered.*Defaults: aten::"):
        PiecewiseConfig.from_options({"extra_splitting_ops": ["nolib::nothing"]})


def test_registered_custom_op_is_accepted_and_overload_stripped():
    import toys.models  # noqa: F401  registers toyattn::attention

    cfg = PiecewiseConfig.from_options({"extra_splitting_ops": ["toyattn::attention.default"]})
    assert cfg.all_splitting_ops == frozenset(DEFAULT_SPLITTING_OPS) | {"toyattn::attention"}


def test_splitting_ops_replaces_defaults():
    cfg = PiecewiseConfig.from_options({"splitting_ops": ["aten::mm"]})
    assert cfg.all_splitting_ops == {"aten::mm"}


def test_config_is_frozen():
    cfg = PiecewiseConfig.from_options({})
    with pytest.raises(Exception):
        cfg.cudagraphs = False


def test_bad_options_fail_through_torch_compile():
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="piecewise", options={"nope": 1})
    with pytest.raises(Exception, match="unknown option"):
        compiled(torch.randn(2, 4))
