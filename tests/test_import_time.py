"""The import-time section of docs/performance.md: written between its markers, kept when run.py rewrites the page."""

from __future__ import annotations

from benchmarks import import_time, run

SECTION = import_time.render(
    {import_time.BASE: [1.0, 1.2, 1.1], import_time.WITH: [1.5, 1.7, 1.6]},
    {"all": 3, "transformers": 0, "modeling": []},
    "python benchmarks/import_time.py",
    [("jaxtyping", "nnterp.core.dims", 0.01)],
)


def test_the_section_gives_the_medians_and_their_difference():
    assert SECTION.startswith(import_time.BEGIN) and SECTION.rstrip().endswith(import_time.END)
    assert "| `import nnsight, transformers` | 1.10 |" in SECTION
    assert "| difference of the medians (target ≤ 1.5 s: met) | 0.50 |" in SECTION
    assert "no modeling module" in SECTION and "| `jaxtyping` | `nnterp.core.dims` | 0.01 |" in SECTION


def test_the_section_is_appended_then_replaced_in_place():
    page = import_time.with_section("# Performance\n\ntable\n", SECTION)
    assert page == "# Performance\n\ntable\n\n" + SECTION
    newer = SECTION.replace("1.10", "9.99")
    assert import_time.with_section(page, newer) == "# Performance\n\ntable\n\n" + newer
    assert import_time.with_section(page, None) == page


def test_the_benchmark_runner_keeps_the_section_when_it_rewrites_the_page(tmp_path):
    out = tmp_path / "performance.md"
    out.write_text("# Performance\n\nold tables\n\n" + SECTION)
    run.write(str(out), "# Performance\n\nnew tables\n")
    assert out.read_text() == "# Performance\n\nnew tables\n\n" + SECTION
