"""`serve` starts the runtime keeper locally (`dispatch-admission keep`) with what its own flags say about the keeper:
the live reads' rate and burst and a namespace's share of the store."""

from __future__ import annotations

import subprocess

from webhook.commands import serve
from webhook.commands.flags import parser


class Started:
    commands: list[list[str]] = []

    def __init__(self, command: list[str]):
        Started.commands.append(command)

    def poll(self) -> int:
        return 0  # gone already: nothing to stop at exit


def test_serve_gives_its_keeper_the_namespace_share_and_the_live_read_bounds(monkeypatch, tmp_path):
    args = parser().parse_args(["serve", "--dev", "--cert-dir", str(tmp_path), "--namespace-share", "4096",
                                "--live-reads-per-second", "3", "--live-reads-burst", "4"])
    monkeypatch.setattr(subprocess, "Popen", Started)
    serve._start_keeper(serve.serve_config(args), str(tmp_path / "store"), master=-1)
    command = Started.commands[-1]
    keep = parser().parse_args(command[command.index("webhook") + 1:])  # what keep itself makes of it
    assert (keep.handler, keep.namespace_share, keep.live_reads_per_second, keep.live_reads_burst) == (
        "keep", 4096, 3.0, 4)


def test_the_keepers_share_defaults_to_the_stores():
    from webhook.core.runtimes import NAMESPACE_SHARE

    assert parser().parse_args(["serve"]).namespace_share == NAMESPACE_SHARE
