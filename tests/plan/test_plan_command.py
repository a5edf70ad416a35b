"""`kv-sidecar plan`: parsing, output, exit codes, and that it stays light."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kv_sidecar.commands import plan as plan_command
from kv_sidecar.commands.plan import IDENTITY_NOTE

PREFILL = {
    "tp_size": 2,
    "num_layers": 4,
    "num_kv_heads": 8,
    "head_dim": 64,
    "dtype": "bfloat16",
    "block_size": 16,
    "num_blocks": 100,
    "layout": "flash_attn_nhd",
}
DECODE = {**PREFILL, "tp_size": 4, "block_size": 32, "num_blocks": 50, "layout": "flash_attn_hnd"}


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    plan_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_json_output_inline_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(DECODE))
    assert run("--prefill", json.dumps(PREFILL), "--decode", str(path), "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode_ranks"][1] == {
        "rank": 1,
        "reads": [{"prefill_rank": 0, "heads": [2, 4]}],
        "notify_only": [],
        "bytes_per_token": [2 * 4 * 2 * 64 * 2],  # heads x layers x K,V x head_dim x bf16
    }
    assert len(out["hash"]) == 64


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            "--prefill",
            json.dumps({**PREFILL, "num_kv_heads": 2, "tp_size": 4}),
            "--decode",
            json.dumps({**PREFILL, "num_kv_heads": 2, "tp_size": 1}),
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "decode rank  reads prefill rank  heads   bytes/decode block  notify only" in out
    assert "0            0                   [0, 1)  16384               1,3" in out
    assert "             2                   [1, 2)  16384" in out


@pytest.mark.parametrize(
    ("decode", "message"),
    [
        ({**DECODE, "num_kv_heads": 4}, "num_kv_heads differs: prefill 8, decode 4"),
        (
            {**DECODE, "layout": "mla", "num_kv_heads": 1},
            "layout differs: prefill flash_attn_nhd, decode mla",
        ),
        ({**DECODE, "tp_size": 3}, "--decode: num_kv_heads 8 and tp_size 3: one must divide the other"),
        ({**DECODE, "colour": "red"}, "--decode: unknown engine spec keys ['colour']"),
    ],
)
def test_impossible_pairings_exit_2(decode: dict, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--prefill", json.dumps(PREFILL), "--decode", json.dumps(decode)) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_packed_nhd_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    packed_nhd = {**PREFILL, "layout": "packed_nhd", "cross_layer": True}
    assert run("--prefill", json.dumps(packed_nhd), "--decode", json.dumps(DECODE), "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefill"]["layout"] == "packed_nhd" and out["prefill"]["cross_layer"] is True
    assert out["decode_ranks"][1]["reads"] == [{"prefill_rank": 0, "heads": [2, 4]}]
    assert out["bytes_per_block"]["prefill_rank"] == 16 * 4 * 4 * 2 * 64 * 2  # tokens x heads x layers x K,V
    assert run("--prefill", json.dumps(packed_nhd), "--decode", json.dumps(packed_nhd)) == 0
    assert IDENTITY_NOTE in capsys.readouterr().out


def test_unknown_layout_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--prefill", json.dumps({**PREFILL, "layout": "lbnhc"}), "--decode", json.dumps(DECODE)) == 2
    err = capsys.readouterr().err
    assert "unknown layout 'lbnhc'" in err and "'packed', 'packed_nhd', 'vllm_cpu', 'mla'" in err


def test_unreadable_spec_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--prefill", str(tmp_path / "missing.json"), "--decode", json.dumps(DECODE)) == 2
    assert "--prefill: cannot read spec file" in capsys.readouterr().err
    assert run("--prefill", "{not json", "--decode", json.dumps(DECODE)) == 2
    assert "--prefill: inline spec is not valid JSON" in capsys.readouterr().err


def test_subprocess_imports_neither_torch_nor_nixl() -> None:
    code = (
        "import argparse, sys\n"
        "from kv_sidecar.commands import plan\n"
        "p = argparse.ArgumentParser(); plan.add_parser(p.add_subparsers())\n"
        "a = p.parse_args(sys.argv[1:]); rc = a.func(a)\n"
        "assert 'torch' not in sys.modules and 'nixl' not in sys.modules, 'heavy import'\n"
        "raise SystemExit(rc)\n"
    )
    argv = ["plan", "--prefill", json.dumps(PREFILL), "--decode", json.dumps(DECODE), "--json"]
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["decode_ranks"][3]["reads"] == [{"prefill_rank": 1, "heads": [6, 8]}]
