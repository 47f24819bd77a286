"""Named optimizer state: exact round trips, upstream layouts, model changes, wrong payloads."""
import io

import pytest
import torch as th

from improved_diffusion.ckpt.optim_state import (
    FORMAT,
    OptimizerStateError,
    load_optimizer_state,
    named_optimizer_state,
    validate_optimizer_payload,
)

from conftest import FIXTURES

RUN_FLAGS = dict(
    image_size=32,
    num_channels=32,
    num_res_blocks=1,
    attention_resolutions="16",
    learn_sigma=True,
    diffusion_steps=100,
    noise_schedule="cosine",
)


def small_unet(**overrides):
    from improved_diffusion.script_util import (
        create_model_and_diffusion,
        model_and_diffusion_defaults,
    )

    flags = model_and_diffusion_defaults()
    flags.update(RUN_FLAGS)
    flags.update(overrides)
    th.manual_seed(0)
    model, _ = create_model_and_diffusion(**flags)
    return model


class Tiny(th.nn.Module):
    def __init__(self, hidden=5, extra=False):
        super().__init__()
        self.a = th.nn.Linear(3, hidden)
        self.norm = th.nn.LayerNorm(hidden)
        self.b = th.nn.Linear(hidden, 2)
        self.scale = th.nn.Parameter(th.tensor(1.5))
        if extra:
            self.c = th.nn.Linear(2, 2)

    def forward(self, x):
        y = self.b(self.norm(self.a(x))) * self.scale
        return self.c(y) if hasattr(self, "c") else y


def fake_steps(model, opt, n=3, seed=0):
    g = th.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = th.randn(p.shape, generator=g)
        opt.step()


def through_file(obj):
    buf = io.BytesIO()
    th.save(obj, buf)
    buf.seek(0)
    return th.load(buf, weights_only=True, map_location="cpu")


def assert_state_dicts_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for name, v in a["state"][k].items():
            assert th.equal(v, b["state"][k][name]), (k, name)


def test_named_state_round_trip_is_bitwise_and_training_continues_identically():
    th.manual_seed(0)
    model = Tiny()
    opt = th.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    fake_steps(model, opt)
    payload = through_file(named_optimizer_state(opt, list(model.named_parameters())))
    assert payload["format"] == FORMAT
    assert payload["optimizer"] == "AdamW"
    assert set(payload["state"]) == {n for n, _ in model.named_parameters()}
    assert payload["shapes"]["a.weight"] == [5, 3]

    clone = Tiny()
    clone.load_state_dict(model.state_dict())
    opt2 = th.optim.AdamW(clone.parameters(), lr=1.0)
    report = load_optimizer_state(opt2, payload, list(clone.named_parameters()), source="opt.pt")
    assert (report.matched, report.fresh, report.dropped, report.reshaped) == (7, 0, 0, 0)
    assert "opt.pt" in report.summary() and "\n" not in report.summary()
    assert_state_dicts_equal(opt2.state_dict(), opt.state_dict())

    fake_steps(model, opt, seed=7)
    fake_steps(clone, opt2, seed=7)
    for p, q in zip(model.parameters(), clone.parameters()):
        assert th.equal(p, q)


def test_named_state_is_a_copy_not_changed_by_later_steps():
    model = Tiny()
    opt = th.optim.AdamW(model.parameters())
    fake_steps(model, opt, n=1)
    payload = named_optimizer_state(opt, list(model.named_parameters()))
    before = payload["state"]["a.weight"]["exp_avg"].clone()
    fake_steps(model, opt, n=1)
    assert th.equal(payload["state"]["a.weight"]["exp_avg"], before)


def test_upstream_fixture_optimizer_loads_with_moments_equal_to_the_file():
    raw = th.load(FIXTURES / "upstream_run_small" / "opt000010.pt", weights_only=True)
    model = small_unet()
    named = list(model.named_parameters())
    opt = th.optim.AdamW(model.parameters(), lr=1e-4)
    report = load_optimizer_state(opt, raw, named, source="opt000010.pt")
    assert (report.matched, report.fresh, report.dropped) == (len(named), 0, 0)
    assert "index-keyed" in report.layout
    loaded = opt.state_dict()
    assert loaded["param_groups"][0]["lr"] == raw["param_groups"][0]["lr"]
    for i in range(len(named)):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert th.equal(loaded["state"][i][k], raw["state"][i][k]), (named[i][0], k)
    assert validate_optimizer_payload(raw, named) is None


def random_moments(model, seed=0):
    g = th.Generator().manual_seed(seed)
    return {
        n: (th.randn(p.shape, generator=g), th.rand(p.shape, generator=g))
        for n, p in model.named_parameters()
    }


def flat_entry(names, moments, view=(-1,)):
    return {
        "step": th.tensor(12.0),
        "exp_avg": th.cat([moments[n][0].reshape(-1) for n in names]).view(*view),
        "exp_avg_sq": th.cat([moments[n][1].reshape(-1) for n in names]).view(*view),
    }


GROUP = {"lr": 2e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}


def check_unflattened(model, opt, moments):
    state = opt.state_dict()["state"]
    for i, (name, _) in enumerate(model.named_parameters()):
        assert th.equal(state[i]["exp_avg"], moments[name][0]), name
        assert th.equal(state[i]["exp_avg_sq"], moments[name][1]), name
        assert float(state[i]["step"]) == 12.0
    assert opt.param_groups[0]["lr"] == 2e-4


def test_improved_diffusion_flat_fp16_layout_unflattens_into_per_parameter_moments():
    model = Tiny()
    moments = random_moments(model)
    names = [n for n, _ in model.named_parameters()]
    raw = {"state": {0: flat_entry(names, moments)}, "param_groups": [dict(GROUP, params=[0])]}
    opt = th.optim.AdamW(model.parameters())
    report = load_optimizer_state(opt, through_file(raw), list(model.named_parameters()))
    assert "1 flat param" in report.layout and report.matched == len(names)
    check_unflattened(model, opt, moments)


def test_guided_diffusion_two_flat_params_unflatten_vectors_then_matrices():
    model = Tiny()
    moments = random_moments(model, seed=1)
    named = list(model.named_parameters())
    vec = [n for n, p in named if p.ndim <= 1]
    mat = [n for n, p in named if p.ndim > 1]
    raw = {
        "state": {0: flat_entry(vec, moments), 1: flat_entry(mat, moments, view=(1, -1))},
        "param_groups": [dict(GROUP, params=[0, 1])],
    }
    opt = th.optim.AdamW(model.parameters())
    report = load_optimizer_state(opt, raw, named)
    assert "2 flat params" in report.layout and report.fresh == 0
    check_unflattened(model, opt, moments)


def test_flat_layout_for_a_different_model_size_is_rejected():
    model = Tiny()
    moments = random_moments(Tiny(hidden=6))
    names = [n for n, _ in Tiny(hidden=6).named_parameters()]
    raw = {"state": {0: flat_entry(names, moments)}, "param_groups": [dict(GROUP, params=[0])]}
    with pytest.raises(OptimizerStateError, match=r"opt9\.pt .*cannot be unflattened"):
        load_optimizer_state(th.optim.AdamW(model.parameters()), raw,
                             list(model.named_parameters()), source="opt9.pt")


def test_adding_an_attention_resolution_keeps_common_moments_and_starts_new_ones_fresh():
    old = small_unet()
    opt = th.optim.AdamW(old.parameters())
    fake_steps(old, opt, n=2)
    payload = through_file(named_optimizer_state(opt, list(old.named_parameters())))

    new = small_unet(attention_resolutions="32,16")
    named = list(new.named_parameters())
    old_names = {n for n, _ in old.named_parameters()}
    added = [n for n, _ in named if n not in old_names]
    assert added, "the bigger model should have new parameters"
    opt2 = th.optim.AdamW(new.parameters())
    report = load_optimizer_state(opt2, payload, named, source="opt000002.pt")
    assert report.fresh == len(added) and report.dropped == 0 and report.reshaped == 0
    assert report.matched == len(named) - len(added)
    assert f"{len(added)} fresh" in report.summary()
    by_param = opt2.state
    for name, p in named:
        if name in old_names:
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert th.equal(by_param[p][k], payload["state"][name][k]), (name, k)
        else:
            assert p not in by_param or not by_param[p]


def test_removed_and_reshaped_parameters_are_dropped_or_fresh():
    old = Tiny(hidden=5, extra=True)
    opt = th.optim.AdamW(old.parameters())
    fake_steps(old, opt)
    payload = named_optimizer_state(opt, list(old.named_parameters()))
    payload["state"]["norm.weight"]["exp_avg"] = th.zeros(7)
    payload["state"]["norm.weight"]["exp_avg_sq"] = th.zeros(7)
    payload["shapes"]["norm.weight"] = [7]
    new = Tiny(hidden=5)
    report = load_optimizer_state(th.optim.AdamW(new.parameters()), payload,
                                  list(new.named_parameters()))
    assert report.dropped == 2 and set(report.dropped_names) == {"c.weight", "c.bias"}
    assert report.reshaped == 1 and report.reshaped_names == ["norm.weight"]
    assert report.fresh == 1 and report.matched == 6
    assert "1 reshaped" in report.summary()


def test_model_state_dict_as_optimizer_payload_names_the_file():
    model = Tiny()
    opt = th.optim.AdamW(model.parameters())
    with pytest.raises(OptimizerStateError, match=r"^run/opt000010\.pt holds a model state dict"):
        load_optimizer_state(opt, model.state_dict(), list(model.named_parameters()),
                             source="run/opt000010.pt")
    assert not opt.state
    reason = validate_optimizer_payload(model.state_dict(), list(model.named_parameters()))
    assert "model state dict" in reason


def test_upstream_model_file_in_the_opt_slot_is_rejected():
    sd = th.load(FIXTURES / "upstream_run_small" / "model000010.pt", weights_only=True)
    model = Tiny()
    with pytest.raises(OptimizerStateError, match="model state dict.*not optimizer state"):
        load_optimizer_state(th.optim.AdamW(model.parameters()), sd,
                             list(model.named_parameters()), source="opt000010.pt")


def test_sgd_state_is_rejected_by_adamw_and_named_sgd_too():
    model = Tiny()
    sgd = th.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fake_steps(model, sgd)
    adamw = th.optim.AdamW(model.parameters())
    named = list(model.named_parameters())
    with pytest.raises(OptimizerStateError, match=r"opt\.pt holds SGD optimizer state.*AdamW"):
        load_optimizer_state(adamw, sgd.state_dict(), named, source="opt.pt")
    with pytest.raises(OptimizerStateError, match="holds SGD optimizer state"):
        load_optimizer_state(adamw, named_optimizer_state(sgd, named), named, source="o.pt")


def test_state_for_another_model_or_another_count_is_rejected():
    model = Tiny()
    other = th.nn.Sequential(th.nn.Linear(4, 4))
    opt = th.optim.AdamW(other.parameters())
    fake_steps(other, opt)
    named = list(model.named_parameters())
    with pytest.raises(OptimizerStateError, match="none of this model's parameters"):
        load_optimizer_state(th.optim.AdamW(model.parameters()),
                             named_optimizer_state(opt, list(other.named_parameters())), named)
    with pytest.raises(OptimizerStateError, match="for 2 parameters but the model has 7"):
        load_optimizer_state(th.optim.AdamW(model.parameters()), opt.state_dict(), named)
    assert validate_optimizer_payload([1, 2], named) == "FILE holds a list, not optimizer state"


def test_tagged_opt_file_and_combined_dict_are_unwrapped():
    model = Tiny()
    opt = th.optim.AdamW(model.parameters())
    fake_steps(model, opt)
    named = list(model.named_parameters())
    payload = named_optimizer_state(opt, named)
    tagged = {"schema": "improved_diffusion.checkpoint", "version": 1, "kind": "opt", "step": 3,
              "optimizer": payload, "trainer": {}}
    assert load_optimizer_state(th.optim.AdamW(model.parameters()), tagged, named).complete
    combined = {"model": model.state_dict(), "opt": opt.state_dict()}
    assert load_optimizer_state(th.optim.AdamW(model.parameters()), combined, named).complete
    tagged_model = {"schema": "improved_diffusion.checkpoint", "kind": "model", "step": 3}
    with pytest.raises(OptimizerStateError, match="tagged model checkpoint"):
        load_optimizer_state(th.optim.AdamW(model.parameters()), tagged_model, named)


def test_param_groups_of_a_different_split_get_hyperparameters_by_name():
    model = Tiny()
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight")]
    no_decay = [p for n, p in named if not n.endswith("weight")]
    opt = th.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                          {"params": no_decay, "weight_decay": 0.0}], lr=5e-4)
    fake_steps(model, opt)
    payload = named_optimizer_state(opt, named)
    single = th.optim.AdamW(model.parameters(), lr=1.0)
    report = load_optimizer_state(single, payload, named)
    assert report.complete
    assert single.param_groups[0]["lr"] == 5e-4
    split = th.optim.AdamW([{"params": no_decay}, {"params": decay}], lr=1.0)
    load_optimizer_state(split, payload, named)
    assert [g["weight_decay"] for g in split.param_groups] == [0.0, 0.1]


# ---------------------------------------------------------------------------------------------
# malformed payloads: refused before the optimizer is touched, with a message naming the fault


def _set(path, value):
    """A mutation: payload[path[0]][path[1]]... = value (or value(old); DEL deletes the key)."""
    def mutate(payload):
        target = payload
        for key in path[:-1]:
            target = target[key]
        if value is DEL:
            del target[path[-1]]
        else:
            target[path[-1]] = value(target[path[-1]]) if callable(value) else value
    return mutate


DEL = object()
A = "a.weight"
NAMED_CASES = {
    "no exp_avg_sq": (_set(["state", A, "exp_avg_sq"], DEL), r"state\['a.weight'\] has no "
                                                            r"'exp_avg_sq'"),
    "no step": (_set(["state", A, "step"], DEL), r"state\['a.weight'\] has no 'step'"),
    "one-element betas": (_set(["param_groups", 0, "betas"], (0.9,)),
                          r"param_groups\[0\]\['betas'\] is \(0\.9,\), not two numbers"),
    "betas a string": (_set(["param_groups", 0, "betas"], "0.9,0.99"), r"'betas'\] is '0\.9"),
    "beta of 1": (_set(["param_groups", 0, "betas"], (0.9, 1.0)), r"not two numbers in \[0, 1\)"),
    "lr a string": (_set(["param_groups", 0, "lr"], "fast"),
                    r"\['lr'\] is 'fast', not a non-negative number"),
    "negative eps": (_set(["param_groups", 0, "eps"], -1e-8), r"\['eps'\] is -1e-08"),
    "weight_decay None": (_set(["param_groups", 0, "weight_decay"], None),
                          r"\['weight_decay'\] is None"),
    "int shapes entry": (_set(["shapes", A], 5), r"shapes\['a.weight'\] is 5, not a list of sizes"),
    "negative size": (_set(["shapes", A], [5, -3]), r"shapes\['a.weight'\] is \[5, -3\]"),
    "shapes a list of names": (_set(["shapes"], lambda s: list(s)),
                               r"'shapes' is .*not a dict of parameter shapes"),
    "state a list of names": (_set(["state"], lambda s: list(s)), r"'state' is .*not a dict"),
    "state entry a tensor": (_set(["state", A], th.zeros(5, 3)),
                             r"state\['a.weight'\] is a float32 tensor of shape \[5, 3\], not a "
                             r"dict"),
    "param_groups a dict": (_set(["param_groups"], lambda g: g[0]),
                            r"'param_groups' is .*not a list"),
    "no param groups": (_set(["param_groups"], []), r"'param_groups' is empty"),
    "group without params": (_set(["param_groups", 0, "params"], DEL),
                             r"param_groups\[0\] has no 'params' list"),
    "group naming an unknown parameter": (
        _set(["param_groups", 0, "params"], lambda p: p + ["zz.weight"]),
        r"param group parameter 'zz.weight' is not in 'shapes'"),
    "group holding an index": (_set(["param_groups", 0, "params"], lambda p: p + [3]),
                               r"\['params'\] holds 3, not parameter names"),
    "name in two groups": (_set(["param_groups"], lambda g: g + [dict(g[0], params=[A])]),
                           r"'a.weight' is listed by two param groups"),
    "state of a name in no group": (lambda p: p["state"].__setitem__("ghost", {}),
                                    r"state\['ghost'\] belongs to no param group"),
    "moment a string": (_set(["state", A, "exp_avg"], "zeros"),
                        r"state\['a.weight'\]\['exp_avg'\] is 'zeros', not a tensor"),
    "moment a number": (_set(["state", A, "exp_avg_sq"], 0.0), r"\['exp_avg_sq'\] is 0\.0, not a "
                                                               r"tensor"),
    "moment of another shape": (_set(["state", A, "exp_avg"], th.zeros(5, 2)),
                                r"\['exp_avg'\] has shape \[5, 2\] but the parameter has "
                                r"shape \[5, 3\]"),
    "integer moment": (_set(["state", A, "exp_avg"], th.zeros(5, 3, dtype=th.int64)),
                       r"\['exp_avg'\] is a int64 tensor .*not floating point"),
    "negative step": (_set(["state", A, "step"], th.tensor(-1.0)),
                      r"\['step'\] is a float32 tensor -1\.0, not a non-negative number"),
    "step a string": (_set(["state", A, "step"], "3"), r"\['step'\] is '3', not a non-negative"),
    "nan step": (_set(["state", A, "step"], th.tensor(float("nan"))),
                 r"\['step'\] is a float32 tensor nan"),
    "step a vector": (_set(["state", A, "step"], th.tensor([1.0, 2.0])),
                      r"\['step'\] is a float32 tensor of shape \[2\]"),
    "optimizer name a list": (_set(["optimizer"], ["AdamW"]), r"'optimizer' is \['AdamW'\], not "
                                                              r"a name"),
}
RAW_CASES = {
    "no exp_avg_sq": (_set(["state", 0, "exp_avg_sq"], DEL), r"state\[0\] has no 'exp_avg_sq'"),
    "one-element betas": (_set(["param_groups", 0, "betas"], [0.9]),
                          r"param_groups\[0\]\['betas'\] is \[0\.9\], not two numbers"),
    "params holding names": (_set(["param_groups", 0, "params"], lambda p: [A] + p[1:]),
                             r"\['params'\] holds 'a.weight', not parameter indices"),
    "state of an unknown index": (lambda p: p["state"].__setitem__(99, dict(p["state"][0])),
                                  r"state\[99\] belongs to no param group"),
    "moments of two shapes": (_set(["state", 1, "exp_avg_sq"], th.zeros(5, 2)),
                              r"state\[1\]\['exp_avg_sq'\] has shape \[5, 2\] but its other "
                              r"moments have shape \[5, 3\]"),
    "negative step": (_set(["state", 0, "step"], -4), r"state\[0\]\['step'\] is -4"),
    "state a list": (_set(["state"], lambda s: list(s.values())), r"'state' is .*not a dict"),
    "param_groups a string": (_set(["param_groups"], "adam"), r"'param_groups' is 'adam', not a "
                                                              r"list"),
}


def _trained_payloads():
    model = Tiny()
    opt = th.optim.AdamW(model.parameters(), lr=3e-3)
    fake_steps(model, opt)
    named = list(model.named_parameters())
    return model, named, through_file(named_optimizer_state(opt, named)), \
        through_file(opt.state_dict())


@pytest.mark.parametrize("layout,case", [("named", c) for c in NAMED_CASES]
                         + [("raw", c) for c in RAW_CASES])
def test_a_malformed_payload_is_refused_naming_the_fault_and_the_optimizer_is_untouched(
        layout, case):
    import copy

    model, named, named_payload, raw_payload = _trained_payloads()
    mutate, message = (NAMED_CASES if layout == "named" else RAW_CASES)[case]
    payload = copy.deepcopy(named_payload if layout == "named" else raw_payload)
    mutate(payload)
    opt = th.optim.AdamW(model.parameters(), lr=1.0)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(OptimizerStateError,
                       match=r"^run/opt000003\.pt holds malformed optimizer state: .*" + message):
        load_optimizer_state(opt, payload, named, source="run/opt000003.pt")
    assert opt.state_dict() == before and not opt.state
    reason = validate_optimizer_payload(payload, named)
    assert reason is not None and reason.startswith("FILE holds malformed optimizer state: ")
    assert "\n" not in reason


def test_the_unmutated_payloads_of_the_malformed_table_load_and_step():
    model, named, named_payload, raw_payload = _trained_payloads()
    for payload in (named_payload, raw_payload):
        opt = th.optim.AdamW(model.parameters())
        assert load_optimizer_state(opt, payload, named).complete
        fake_steps(model, opt, n=1)


def test_old_torch_integer_steps_load_as_tensors_and_the_optimizer_steps():
    model, named, _, raw_payload = _trained_payloads()
    for entry in raw_payload["state"].values():
        entry["step"] = int(entry["step"])  # torch < 1.12 saved Adam's step as an int
    opt = th.optim.AdamW(model.parameters())
    assert load_optimizer_state(opt, raw_payload, named).complete
    assert all(isinstance(s["step"], th.Tensor) for s in opt.state.values())
    fake_steps(model, opt, n=1)
    assert all(float(s["step"]) == 4.0 for s in opt.state.values())
