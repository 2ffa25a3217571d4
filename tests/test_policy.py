"""`eo.Policy`: the presets' fields, overrides, hashing (a static argument), and the
policies it refuses."""

import warnings

import pytest

import eqx_offload as eo
from eqx_offload.internal import split_names

from .helpers import unchecked


def test_presets_match_the_table():
    table = {
        "none": (None, "all", (), "device"),
        "remat": (None, (), (), "device"),
        "offload_residuals": (None, (), ("**.input",), "device"),
        "offload_all": ("pinned_host", (), ("**.input",), "pinned_host"),
    }
    for name, expected in table.items():
        p = getattr(eo.Policy, name)()
        assert (p.params, p.save, p.offload, p.opt_state) == expected, name
        assert p.offload_dst == "pinned_host"


def test_presets_take_overrides():
    p = eo.Policy.remat(opt_state="pinned_host")
    assert p.opt_state == "pinned_host" and p.save == ()
    p = eo.Policy.offload_all(params={"blocks": "pinned_host"})
    assert p.params == (("blocks", "pinned_host"),)
    assert p.offload == ("**.input",)


def test_single_string_is_one_name():
    assert eo.Policy(offload="blocks.input").offload == ("blocks.input",)


def test_policy_is_hashable_and_static():
    assert hash(eo.Policy.offload_all()) == hash(eo.Policy.offload_all())
    assert eo.Policy(params={"a": "device"}) == eo.Policy(params={"a": "device"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"save": ("blocks.input",), "offload": ("blocks.input",)},
            "both `save` and `offload`",
        ),
        ({"save": "all", "offload": ("blocks.input",)}, r"save='all'"),
        ({"opt_state": "hbm"}, r"Policy\(opt_state=\.\.\.\)`.*valid kinds"),
        ({"params": "gpu"}, r"Policy\(params=\.\.\.\)`.*valid kinds"),
        ({"params": {"blocks": "disk"}}, r"\['blocks'\]`.*valid kinds"),
        ({"params": {"": "device"}}, "non-empty leaf path patterns"),
        ({"offload_dst": "device"}, "offload_dst='device'.*only be"),
        ({"offload": ("",)}, "non-empty"),
        (
            {"loss_axes": "Explicit"},
            r"Policy\(loss_axes='Explicit'\)`: valid values are 'auto' and 'explicit'",
        ),
    ],
)
def test_bad_policies(kwargs, match):
    with unchecked(), pytest.raises(ValueError, match=match):
        eo.Policy(**kwargs)


def test_bad_types():
    # With runtime type checking on (as in these tests) the type checker names the
    # parameter; without it, our own `TypeError` does.
    with pytest.raises(TypeError, match="offload"):
        eo.Policy(offload=3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="params"):
        eo.Policy(params=["blocks"])  # pyright: ignore[reportArgumentType]


def test_overlapping_patterns_are_an_error_when_names_are_known():
    policy = eo.Policy(save=("blocks.*",), offload=("**.input",))
    with pytest.raises(ValueError, match=r"'blocks\.input' matches `save` pattern"):
        split_names(policy, ["blocks.input"])
    assert split_names(policy, ["blocks.mlp", "x.input"]) == (
        ["blocks.mlp"],
        ["x.input"],
    )


def test_offload_destination_must_be_pinned_host():
    with pytest.raises(ValueError, match=r"offload_dst='unpinned_host'.*'pinned_host'"):
        eo.Policy(offload_dst="unpinned_host")


def test_experimental_settings_warn_once_each(monkeypatch):
    """`prefetch=1`, `update_timing="next_forward"` and `update="host"`: an
    `ExperimentalWarning` (a `UserWarning`) at the caller's line naming the
    setting, its measured value and its page, once per process each."""
    monkeypatch.setattr("eqx_offload._policy_args.WARNED", set())
    settings = {
        "prefetch=1": dict(prefetch=1),
        "update_timing='next_forward'": dict(update_timing="next_forward"),
        "update='host'": dict(update="host"),
    }
    for name, fields in settings.items():
        with pytest.warns(eo.ExperimentalWarning, match=f"{name}.*H200") as record:
            eo.Policy.offload_all(**fields)
        assert record[0].filename == __file__
        assert issubclass(record[0].category, UserWarning)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            eo.Policy.offload_all(**fields)  # once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eo.Policy.offload_all()
