"""bench.step_timeline's accounting (the GPU run traces a graph; here, kernel intervals made up by hand): each
kernel is charged what it adds to the step, the shares sum to the traced step, layers are found by their
kernels' sequence."""

from __future__ import annotations

from bench import step_timeline as timeline

KDA_LAYER = ["_add_rms_norm_kernel", "_gemv_kernel", "_kda_step_kernel", "_gemv_kernel", "_add_rms_norm_kernel",
             "_router_kernel", "_route_token_kernel", "_gate_up_kernel", "_down_kernel"]


def test_a_kernel_is_charged_what_it_adds_to_the_step():
    step = [dict(name="_gemv_kernel", start=0.0, end=10.0),
            dict(name="_kda_step_kernel", start=8.0, end=12.0),  # launched early: waited inside for 2 us
            dict(name="_add_rms_norm_kernel", start=11.0, end=11.5)]  # ends before the latest end: adds nothing
    rows = timeline.shares(step)
    assert [r["share"] for r in rows] == [10.0, 2.0, 0.0]
    assert [r["dur"] for r in rows] == [10.0, 4.0, 0.5] and [r["lead"] for r in rows] == [0.0, 2.0, 1.0]
    assert sum(r["share"] for r in rows) == step[-2]["end"] - step[0]["start"]


def test_layers_are_found_and_shares_summed_per_kernel():
    steps = []
    for _ in range(3):
        t, kernels = 0.0, []
        for layer in range(4):
            for name in KDA_LAYER:
                kernels.append(dict(name=name, start=t, end=t + 2.0 + layer))  # each overlaps the next by 1 us
                t += 1.0 + layer
        steps.append(kernels)
    a = timeline.analyse(steps)
    assert a["traced_step_us"] == steps[0][-1]["end"]
    assert sum(k["share_us"] for k in a["kernels"]) == a["traced_step_us"]
    assert {k["kernel"]: k["launches"] for k in a["kernels"]}["gemv_kernel"] == 8
    (layers,) = a["layers"]
    assert layers["layers"] == 4 and [k["kernel"] for k in layers["kernels"]] == [n.strip("_") for n in KDA_LAYER]
