"""`python -m cbnb.bench` refuses bad arguments before loading any model, with argparse's usage message."""

from __future__ import annotations

import pytest

from cbnb import bench


@pytest.mark.parametrize("argv, text", [
    (["--scale", "0"], "--scale must be in (0, 1]"),
    (["--scale", "1.5"], "--scale must be in (0, 1]"),
    (["--peers", "cbnb,foo"], "--peers: unknown 'foo'; choose from cbnb, hf-cb, hf-static, llama-cpp, llama-cpp-q4_1"),
    (["--workload", "nope"], "invalid choice"),
])
def test_bad_arguments_exit_with_usage(argv, text, capsys, monkeypatch):
    def no_models(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(bench, "run_bench", no_models)
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert text in err and err.startswith("usage: python -m cbnb.bench")


def test_good_arguments_parse():
    args = bench.parse_args(["--workload", "cpu-32", "--scale", "0.5", "--peers", "cbnb, hf-cb"])
    assert args.scale == 0.5 and args.workload == "cpu-32"
