"""Pages generated from the code stay current: docs/configuration.md is what `splitspec docs config` writes from the
app config's field descriptions (one source for every setting); the figures tables of the README and
docs/benchmarks.md are what `splitspec bench report` builds from the committed JSON."""

from splitspec import config_docs
from splitspec.cli import main


def test_the_configuration_page_is_current():
    assert config_docs.PAGE.read_text() == config_docs.render(), "run `splitspec docs config`"
    assert main(["docs", "config", "--check"]) == 0


def test_every_setting_has_a_description():
    keys = [key for key, _, text in config_docs.rows() if not text]
    assert not keys, f"settings without a description: {keys}"
    assert any(key == "stages.<prefill|draft|verify>.placement.cpus" for key, _, _ in config_docs.rows())


def test_the_figures_table_is_the_committed_json():
    from splitspec.bench import report as bench_report

    for page in bench_report.PAGES:
        assert bench_report.page_table(page) == bench_report.table(page), f"{page}: run `splitspec bench report`"
    for figure in bench_report.FIGURES:
        assert (bench_report.ROOT / figure.json).exists(), figure.json
