"""summary.json numbers from hand-made records (space/eval/report.py): each test pins one figure of
the paper table that a plausible slip would silently change; no model runs."""
import pytest

from space.eval.report import summarize, to_markdown


def rec(q, model, tokens, wall, ids=None, **choice):
    """One (question, method) record; ``tokens`` and ``wall`` per turn (lists) or for one turn."""
    tokens = tokens if isinstance(tokens, list) else [tokens]
    wall = wall if isinstance(wall, list) else [wall]
    return {"question_id": q, "category": "c", "model_id": model,
            "choices": [{"new_tokens": tokens, "wall_time": wall, "steps": tokens,
                         "accept_lengths": [[] for _ in tokens],
                         "token_ids": ids or [[0] * n for n in tokens], **choice}]}


def test_tokens_per_s_sums_the_wall_time_of_every_turn():
    """A two-turn question (MT-Bench): tokens/s is all turns' tokens over all turns' wall time; a
    sum over the first turn's time only doubled SPACE's speed here."""
    records = [rec("q0", "ar", [10, 30], [2.0, 2.0]), rec("q0", "space", [10, 30], [1.0, 1.0])]
    s = summarize(records, {"mask_num": 3})
    assert s["methods"]["space"]["wall_time_s"] == 2.0
    assert s["methods"]["space"]["tokens_per_s"] == 20.0 and s["methods"]["ar"]["tokens_per_s"] == 10.0
    assert s["speedup"]["space_vs_ar"] == 2.0


def test_a_question_skipped_for_one_method_counts_in_no_methods_numbers():
    """A later turn can overflow the context on one method's answers and not another's
    (``bench.run_question``): the question then leaves every method's numbers, or SPACE's
    speedup would compare other questions' times (AR's slow q1 against SPACE's q0 alone)."""
    records = [rec("q0", "ar", 10, 1.0), rec("q0", "space", 10, 0.5), rec("q1", "ar", 10, 5.0),
               {"question_id": "q1", "category": "c", "model_id": "space", "skipped": "turn 2's prompt ..."}]
    s = summarize(records, {"mask_num": 3})
    assert s["methods"]["ar"]["tokens_per_s"] == 10.0 and s["speedup"]["space_vs_ar"] == 2.0
    assert s["skipped"] == {"count": 1, "questions": {"q1": "turn 2's prompt ..."}}


def test_speedup_vs_pld_is_over_pld_not_ar():
    """Each speedup divides by its own baseline's tokens/s: SPACE vs PLD taken over AR's tokens/s
    read 4.00 in the PLD column where SPACE is 2x PLD."""
    records = [rec("q0", "ar", 10, 2.0), rec("q0", "pld", 10, 1.0), rec("q0", "space", 10, 0.5)]
    s = summarize(records, {"mask_num": 3, "lookup_tokens": 10})
    assert s["speedup"] == {"pld_vs_ar": 2.0, "space_vs_ar": 4.0, "ar_vs_pld": 0.5, "space_vs_pld": 2.0}
    assert s["median_question_speedup"]["space_vs_pld"] == 2.0
    assert "| space | 10 | 0.5 | 20.00 | 1.00 | 4.00 | - | 2.00 | - |" in to_markdown(s)


def test_pass_at_1_and_pass_at_n_count_only_passed_samples():
    """Two samples per question: a timed-out sample is a failure (never a pass), and pass@2 is the
    unbiased pass@k with k = 2, not pass@1 again."""
    def exec_(passed, result):
        return {"passed": passed, "result": result}

    def two(q, first, second):
        r = rec(q, "space", 4, 1.0)
        r["choices"] = [{**r["choices"][0], "index": i, "exec": e} for i, e in enumerate((first, second))]
        return r

    records = [two("q0", exec_(True, "passed"), exec_(False, "timed out")),
               two("q1", exec_(False, "failed: AssertionError"), exec_(False, "timed out"))]
    s = summarize(records, {"mask_num": 3})
    assert s["pass_at_1"]["space"] == pytest.approx(0.25)  # q0: 1 of 2, q1: 0 of 2
    assert s["pass_at_2"]["space"] == pytest.approx(0.5)  # q0: some sample passes, q1: none


def test_exact_match_compares_every_turn_whole():
    """Greedy exactness is over every turn's ids, the whole sequence: a second turn that differs,
    or SPACE running past AR's last token, is not exact (each was counted exact by a slip). A
    sample is exact when all its turns are (DESIGN §6; it was the share of turns, 0.5 here)."""
    ar = [rec("q0", "ar", [2, 2], [1.0, 1.0], ids=[[1, 2], [3, 4]]),
          rec("q1", "ar", [2, 2], [1.0, 1.0], ids=[[1, 2], [3, 4]])]
    space = [rec("q0", "space", [2, 2], [1.0, 1.0], ids=[[1, 2], [3, 5]]),  # second turn differs
             rec("q1", "space", [2, 3], [1.0, 1.0], ids=[[1, 2], [3, 4, 6]])]  # one token past AR's
    s = summarize(ar + space, {"mask_num": 3, "temperature": 0.0})
    assert s["exact_match_rate"] == 0.0 and s["exact_turn_rate"] == 0.5
    again = summarize(ar + [space[0], rec("q1", "space", [2, 2], [1.0, 1.0], ids=[[1, 2], [3, 4]])], {"mask_num": 3, "temperature": 0.0})
    assert again["exact_match_rate"] == 0.5 and again["exact_turn_rate"] == 0.75


def test_host_share_is_over_the_records_that_time_the_host():
    """A resumed run mixes records from before host times were stored: the host share is over the
    wall time of the records that have them (it was halved by the older record's time)."""
    new = rec("q0", "space", 10, 1.0, host_ms=[[100.0, 100.0]], plan_ms=[[10.0, 10.0]])
    old = rec("q1", "space", 10, 1.0)
    m = summarize([new, old], {"mask_num": 3})["methods"]["space"]
    assert m["host_share"] == 0.2 and m["host_ms_per_step"] == 100.0 and m["plan_ms_per_step"] == 10.0


def test_exactness_only_for_greedy_runs():
    """Sampled SPACE and AR draw different tokens by design: a sampled run reports no exactness
    (a rate near 0 % there read as a broken decoder)."""
    records = [rec("q0", "ar", 2, 1.0, ids=[[1, 2]]), rec("q0", "space", 2, 1.0, ids=[[1, 3]])]
    assert summarize(records, {"mask_num": 3, "temperature": 0.0})["exact_match_rate"] == 0.0
    assert "exact_match_rate" not in summarize(records, {"mask_num": 3, "temperature": 0.7})


def test_pass_at_1_is_n_a_only_when_no_sample_ran_its_tests():
    """Every result "n/a" (no toolchain) reports "n/a"; a run where some samples did run their
    tests (a resume on a machine with the toolchain) reports their pass rate, not "n/a", and not
    with the samples that never ran counted as failures (it said 0.5 here); how many did not run is
    in the summary."""
    def one(q, result):
        r = rec(q, "space", 4, 1.0)
        r["choices"][0]["exec"] = {"passed": result == "passed", "result": result}
        return r

    na = "n/a (no toolchain)"
    assert summarize([one("q0", na), one("q1", na)], {"mask_num": 3})["pass_at_1"]["space"] == na
    mixed = summarize([one("q0", na), one("q1", "passed"), one("q2", "failed: exit 1")], {"mask_num": 3})
    assert mixed["pass_at_1"]["space"] == 0.5 and mixed["tests_not_run"] == {"space": 1}
    from space.eval.report import to_markdown

    assert "as Go's, when made): space 1" in to_markdown(mixed)
    assert "tests_not_run" not in summarize([one("q0", "passed")], {"mask_num": 3})


@pytest.mark.parametrize("device, label", [("cpu", "Host work per SPACE step"),
                                           ("cuda", "includes waiting for the GPU's queued work"),
                                           ("cuda:1", "includes waiting for the GPU's queued work"),  # a launched rank
                                           ("cuda:0, cuda:1", "includes waiting for the GPU's queued work")])
def test_host_time_line_says_what_it_holds_on_each_device(device, label):
    """On CUDA the forward only enqueues work (a captured step: one graph replay), so the time
    outside it holds the wait at the step's read: an H200 run labelled 8-13 ms of it, 90 % of the
    step, "host work" (results/gpu_h200_g58)."""
    space = rec("q0", "space", 2, 1.0, host_ms=[[5.0, 7.0]], plan_ms=[[0.5, 0.5]])
    s = summarize([rec("q0", "ar", 2, 2.0), space], {"mask_num": 3, "device": device})
    md = to_markdown(s)
    assert "median 6.000 ms" in md and label in md
    assert ("Host work" in md) == (device == "cpu")


def test_a_run_whose_tests_never_ran_reports_n_a_and_no_not_run_count():
    """Every sample "n/a" (no toolchain at all): pass@1 is "n/a", and the summary carries no
    ``tests_not_run`` count nor the "pass@1 over the samples whose tests ran" line, which would
    claim a pass rate over samples that ran when none did."""
    r = rec("q0", "space", 4, 1.0)
    r["choices"][0]["exec"] = {"passed": False, "result": "n/a (no toolchain)"}
    s = summarize([r, {**r, "question_id": "q1"}], {"mask_num": 3})
    assert s["pass_at_1"]["space"] == "n/a (no toolchain)" and "tests_not_run" not in s
    assert "when made): " not in to_markdown(s)


@pytest.mark.parametrize("device, other", [("cuda:0", True), ("cuda:0, cuda:1", True), ("cpu", False)])
def test_the_layout_says_a_curve_of_another_device_type_priced_the_steps(device, other):
    """A dynamic tree priced by a stored curve of another device type than the run's (the shipped
    CPU curves on a GPU) says so in the layout line; one of the run's own type, whatever its index,
    says nothing; a curve measured at load says that instead."""
    from space.eval.report import layout_text

    meta = {"tree": "dynamic", "mask_num": 3, "num_groups": 4, "row_budget": 32, "device": device,
            "step_cost_setup": {"device": "cpu", "threads": 2, "kernels": "fast", "capture": False}}
    assert ("steps priced by a cpu step-cost curve" in layout_text(meta)) == other
    cuda_curve = {**meta, "step_cost_setup": {**meta["step_cost_setup"], "device": "cuda"}}
    assert ("steps priced by a cuda step-cost curve" in layout_text(cuda_curve)) == (not other)
    measured = {**meta, "step_cost_setup": {**meta["step_cost_setup"], "measured": "at load", "seconds": 2.5}}
    assert "steps priced by this machine's step cost, measured at load in 2.5 s" in layout_text(measured)


def test_the_dynamic_layout_names_its_lookup_and_datastore_branches():
    """The dynamic tree's words give prompt lookup's continuations a step and the datastore's (its own
    ``datastore_branches``, not lookup's count), with the datastore's size; none without one."""
    from space.eval.report import layout_text

    meta = {"tree": "dynamic", "mask_num": 3, "num_groups": 4, "row_budget": 32, "lookup_tokens": 10,
            "lookup_branches": 4, "datastore_branches": 2, "datastore": {"sets": "a.jsonl", "tokens": 12345}}
    said = layout_text(meta)
    assert "prompt lookup 10 tokens, 4 continuation(s), 2 more from a datastore of 12,345 tokens" in said
    assert layout_text({**meta, "datastore": None}).endswith("prompt lookup 10 tokens, 4 continuation(s)")
