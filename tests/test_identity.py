"""experiments/identity.py's own logic: where two answers part, and its table (the full run is the experiment)."""

from conftest import experiment_script


def test_first_difference_and_the_table():
    identity = experiment_script("identity")
    assert identity.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert identity.first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert identity.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early: it parts where it stopped
    report = {"command": "python experiments/identity.py", "cpu": "cpu", "threads": 1, "torch": "2", "date": "d",
              "reference": "HF generate, float32", "sets": {"humaneval": 2, "question": 1}, "max_new_tokens": 8,
              "methods": [{"method": "ar (ours)", "computes": "ours", "contexts": 3, "identical": 3, "mismatches": []},
                          {"method": "llama_cpp", "computes": "8-bit", "contexts": 3, "identical": 1, "mismatches": [
                              {"margin": 0.5, "pos": 4, "their_rank": 1}, {"margin": 0.01, "pos": 9, "their_rank": 1}]}]}
    md = identity.render(report)
    assert "| ar (ours) | ours | 3/3 | 0 | — |" in md
    assert "| llama_cpp | 8-bit | 1/3 | 2 | 0.255 | 0.01, 0.5 | 4, 9 | 1, 1 |" in md
