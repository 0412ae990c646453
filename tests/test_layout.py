"""The house's rules (specdec/layout_check.py) hold for the package as it is, and the check sees a broken one."""

from pathlib import Path

from specdec import layout_check


def test_the_algorithm_and_the_drafters_import_no_engine_and_nothing_imports_in_a_circle():
    assert layout_check.problems() == []


def test_a_broken_house_is_reported(tmp_path):
    root = tmp_path / "specdec"
    for folder in ("sampling", "engines", "drafters"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "sampling" / "decode.py").write_text("from specdec.engines import fast\n")
    (root / "engines" / "fast.py").write_text("def f():\n    from specdec.drafters import hydra\n")
    (root / "drafters" / "hydra.py").write_text("from specdec.sampling import decode\n")
    found = layout_check.problems(Path(root))
    assert "specdec.sampling.decode imports specdec.engines.fast: specdec.sampling may not import specdec.engines" in found
    assert any(line.startswith("specdec.drafters.hydra imports specdec.sampling.decode") for line in found)
    assert any(line.startswith("import circle:") and "specdec.engines.fast" in line for line in found)
