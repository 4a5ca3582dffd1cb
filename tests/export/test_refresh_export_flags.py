"""scripts/refresh_export_flags.py reads CLI flags from a wheel's source with `ast` (tiny fake wheels: no network)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import textwrap
import zipfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "refresh_export_flags.py"


@pytest.fixture(scope="module")
def refresh():
    spec = importlib.util.spec_from_file_location("refresh_export_flags", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(path: pathlib.Path, name: str, version: str, files: dict[str, str]) -> pathlib.Path:
    whl = path / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for n, text in files.items():
            zf.writestr(n, textwrap.dedent(text))
        zf.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")
    return whl


VLLM = {
    "vllm/config/cache.py": '''
        class CacheConfig:
            DEFAULT: ClassVar[int] = 16
            block_size: int = 16
            enable_prefix_caching: bool = True
            mode: bool | str | None = None
        ''',
    "vllm/engine/arg_utils.py": '''
        class EngineArgs:
            @staticmethod
            def add_cli_args(parser):
                cache_kwargs = get_kwargs(CacheConfig)
                g = parser.add_argument_group("CacheConfig")
                g.add_argument("--block-size", **cache_kwargs["block_size"])
                g.add_argument("--enable-prefix-caching", **{**cache_kwargs["enable_prefix_caching"], "default": None})
                g.add_argument("--mode", **cache_kwargs["mode"])
                g.add_argument("--max-num-seqs", type=int)
                g.add_argument("--max-num-batched-tokens", type=int)
                g.add_argument("--seed", "-s", type=int)
                g.add_argument("--enforce-eager", action="store_true")
                return parser

        class AsyncEngineArgs(EngineArgs):
            @staticmethod
            def add_cli_args(parser):
                parser = EngineArgs.add_cli_args(parser)
                parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction)
                return parser
        ''',
    "vllm/entrypoints/common/cli_args.py": '''
        class BaseFrontendArgs:
            host: str | None = None
            @classmethod
            def add_cli_args(cls, parser):
                frontend_kwargs = get_kwargs(cls)
                for key, value in frontend_kwargs.items():
                    parser.add_argument(f"--{key.replace('_', '-')}", **value)
                return parser

        class FrontendArgs(BaseFrontendArgs):
            port: int = 8000
            disable_fastapi_docs: bool = False

        def make_arg_parser(parser):
            parser.add_argument("model_tag", nargs="?")
            parser.add_argument("--headless", action="store_true")
            parser = FrontendArgs.add_cli_args(parser)
            parser = AsyncEngineArgs.add_cli_args(parser)
            return parser
        ''',
}

SGLANG = {
    "sglang/srt/arg_groups/fields/schedule.py": '''
        class Schedule(msgspec.Struct):
            _NS_PATH = "schedule"
            page_size: A[Optional[int], Arg(help="tokens per page", resolvable=True)] = None
            max_running_requests: A[Optional[int], "The maximum number of running requests."] = None
            disable_radix_cache: A[bool, "Disable the radix cache."] = False
            tp_size: A[int, Arg(help="tp", cli_name="--tensor-parallel-size", aliases=["--tp-size"])] = 1
            hidden: A[bool, Arg(no_cli=True)] = False
            plain: int = 0
        ''',
    "sglang/srt/arg_groups/fields/model.py": '''
        class Model(msgspec.Struct):
            model_path: A[str, "The model."] = ""
            port: A[int, "Port."] = 30000
            mem_fraction_static: A[Optional[float], "Fraction."] = None
        ''',
    "sglang/srt/server_args.py": '''
        from sglang.srt.arg_groups.fields.schedule import Schedule

        class ServerArgs:
            @staticmethod
            def add_cli_args(parser):
                add_cli_args_from_dataclass(parser, ServerArgs)
                parser.add_argument("--config", type=str)
                parser.add_argument("--disable-cuda-graph", action=DeprecatedStoreTrueAction, new_flag="x")

        _INPUT_NAMESPACES = [
            Model,
            Schedule,
        ]
        ''',
}


def test_vllm_flags_follow_the_parser_it_builds(refresh, tmp_path):
    whl = _wheel(tmp_path, "vllm", "9.9.9", VLLM)
    out = refresh.refresh("vllm", whl, tmp_path / "data")
    d = json.loads(out.read_text())
    assert out.name == "vllm-9.9.9.json" and d["version"] == "9.9.9" and d["program"] == "vllm serve"
    assert set(d["flags"]) == {"--headless", "--host", "--port", "--disable-fastapi-docs", "--no-disable-fastapi-docs",
                               "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching", "--mode",
                               "--max-num-seqs", "--max-num-batched-tokens", "--seed", "-s", "--enforce-eager",
                               "--enable-log-requests", "--no-enable-log-requests"}
    # a bool field becomes BooleanOptionalAction (a --no- twin); `bool | str | None` takes a value
    assert {"--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager", "--headless"} <= set(
        d["switches"]) and "--mode" not in d["switches"] and "--block-size" not in d["switches"]
    assert len(d["wheel_sha256"]) == 64 and d["parser"].endswith("make_arg_parser")


def test_sglang_flags_follow_its_namespaces(refresh, tmp_path):
    whl = _wheel(tmp_path, "sglang", "0.0.1", SGLANG)
    d = json.loads(refresh.refresh("sglang", whl, tmp_path / "data").read_text())
    assert set(d["flags"]) == {"--model-path", "--port", "--mem-fraction-static", "--page-size",
                               "--max-running-requests", "--disable-radix-cache", "--tensor-parallel-size",
                               "--tp-size", "--config", "--disable-cuda-graph"}
    assert set(d["switches"]) == {"--disable-radix-cache", "--disable-cuda-graph"}


def test_a_parser_built_another_way_fails_loudly(refresh, tmp_path):
    broken = dict(VLLM)
    broken["vllm/engine/arg_utils.py"] = VLLM["vllm/engine/arg_utils.py"].replace('"--max-num-seqs"', '"--other"')
    with pytest.raises(SystemExit, match="missed.*--max-num-seqs"):
        refresh.refresh("vllm", _wheel(tmp_path, "vllm", "9.9.8", broken), tmp_path / "data")
    with pytest.raises(SystemExit, match="_INPUT_NAMESPACES"):
        refresh.refresh("sglang", _wheel(tmp_path, "sglang", "0.0.2", {
            "sglang/srt/server_args.py": "class ServerArgs:\n    pass\n"}), tmp_path / "data")
