"""ServeConfig: the one place every flag of ``python -m kvflow.serve`` is written. The parser is
generated from its fields, children get it as JSON, and each flag combination that would be
silently ignored is one exact line."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvflow.serve.__main__ import build_parser, check_args, parse_args
from kvflow.serve.launch.config import ServeConfig, cli_fields, default_of, flag_name, meta
from kvflow.serve.launch.server import instance_config
from kvflow.serve.launch.startup import StartupError

REMOVED = ["--transfer", "--ipc-direction", "--transfer-mode", "--layerwise-max-ctas",
           "--layers-per-copy"]


def test_every_field_is_a_flag_with_help_and_its_default():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for f in cli_fields():
        action = actions[f.name]
        assert action.option_strings == [flag_name(f.name)]
        assert meta(f, "help") and meta(f, "help") in action.help, f.name
        if f.type != "bool":
            shown = meta(f, "default_text") or default_of(f)
            assert action.help.endswith(f"(default: {shown})"), f.name
    internal = {f.name for f in dataclasses.fields(ServeConfig)} - {f.name for f in cli_fields()}
    assert internal == {"heartbeat_s", "parent_pid"} and not internal & set(actions)
    assert len(cli_fields()) == 37  # 31 + kv_layout, kv_dtype, decode_{block_size,kv_layout,kv_dtype}, kv_verify
    flags = {s for a in parser._actions for s in a.option_strings}
    assert not flags & set(REMOVED)


def test_no_flag_gives_the_field_defaults(monkeypatch):
    monkeypatch.delenv("KVFLOW_API_KEY", raising=False)
    assert parse_args([]) == ServeConfig()


@pytest.mark.parametrize("flag", REMOVED)
def test_removed_transport_flags_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        parse_args([flag, "1"])
    assert f"unrecognized arguments: {flag} 1" in capsys.readouterr().err


def test_a_child_gets_the_config_as_json_and_reads_it_back():
    parent = parse_args(["--kv-connector", "ipc-push", "--kv-connector-config",
                         '{"layers_per_copy": 2, "max_ctas": 8}', "--layerwise-min-tokens", "64",
                         "--kv-lease-s", "3", "--enable-prefix-caching", "--api-key", "s3cret",
                         "--max-model-len", "256"])
    child = instance_config(parent, "decode", "tcp://127.0.0.1:5555")
    assert ServeConfig.from_json(child.to_json()) == child
    assert parse_args(["--config-json", child.to_json()]) == child
    assert dataclasses.replace(child, role="all", router_url=None, api_key="s3cret",
                               parent_pid=None) == parent
    assert (child.role, child.api_key, child.parent_pid) == ("decode", None, os.getpid())
    assert "s3cret" not in child.to_json()


def test_p_and_d_on_one_gpu_get_half_the_fraction_each():
    parent = parse_args(["--device", "cuda", "--decode-device", "0",
                         "--gpu-memory-utilization", "0.8"])
    assert instance_config(parent, "prefill", "tcp://h:1").gpu_memory_utilization == 0.4
    alone = parse_args(["--device", "cuda", "--gpu-memory-utilization", "0.8"])
    assert instance_config(alone, "prefill", "tcp://h:1").gpu_memory_utilization == 0.8


@pytest.mark.parametrize("text, line", [
    ('{"role": "decode", "colour": 1}', "--config-json: ServeConfig has no setting colour"),
    ("[1]", "--config-json: a ServeConfig is a JSON object, got list"),
])
def test_a_bad_config_json_is_one_line(text, line):
    with pytest.raises(StartupError) as info:
        check_args(["--config-json", text])
    assert str(info.value) == "kvflow.serve: error: " + line


def line_of(argv: list[str]) -> str:
    with pytest.raises(StartupError) as info:
        check_args(argv)
    return str(info.value).removeprefix("kvflow.serve: error: ")


@pytest.mark.parametrize("argv, line", [
    (["--kv-connector", "nixl", "--kv-layout", "BM_NHD", "--decode-kv-layout", "NHD"],
     "--decode-kv-layout NHD differs from P's BM_NHD, and the nixl connector moves only equal KV "
     "cache specs (re-blocking connectors: ipc-pull, ipc-push, tcp); leave it out or pick one of "
     "those"),
    (["--kv-connector", "nixl", "--decode-block-size", "64"],
     "--decode-block-size 64 differs from P's 16, and the nixl connector moves only equal KV "
     "cache specs (re-blocking connectors: ipc-pull, ipc-push, tcp); leave it out or pick one of "
     "those"),
    (["--kv-connector-config", "{max_ctas: 8}"],
     "--kv-connector-config is not valid JSON (Expecting property name enclosed in double "
     "quotes: line 1 column 2 (char 1)), got '{max_ctas: 8}'; pass an object such as "
     "'{\"max_ctas\": 16}'"),
    (["--kv-connector-config", "[8]"],
     "--kv-connector-config must be a JSON object such as '{\"max_ctas\": 16}', got '[8]'"),
    (["--kv-connector-config", '{"max_ctas": 8}'],  # auto on CPU is ipc-pull
     "--kv-connector-config key 'max_ctas' is not an option of connector 'ipc-pull' (it takes "
     "receive_max_ctas)"),
    (["--kv-connector", "ipc-push", "--kv-connector-config", '{"max_cta": 8}'],
     "--kv-connector-config key 'max_cta' is not an option of connector 'ipc-push' (it takes "
     "layers_per_copy, max_ctas)"),
    (["--kv-connector", "ipc-push", "--kv-connector-config", '{"max_ctas": 0}'],
     "--kv-connector-config key 'max_ctas' of connector 'ipc-push' must be an int >= 1; got 0"),
    (["--kv-connector", "ipc-push", "--kv-connector-config", '{"layers_per_copy": true}'],
     "--kv-connector-config key 'layers_per_copy' of connector 'ipc-push' must be an int >= 1; "
     "got True"),
    (["--kv-connector", "ipc-push", "--kv-connector-config", '{"layers_per_copy": 2.0}'],
     "--kv-connector-config key 'layers_per_copy' of connector 'ipc-push' must be an int >= 1; "
     "got 2.0"),
    (["--kv-connector", "nixl", "--kv-connector-config", '{"write_timeout_s": 0}'],
     "--kv-connector-config key 'write_timeout_s' of connector 'nixl' must be a number of "
     "seconds > 0; got 0"),
    (["--kv-connector", "nixl", "--kv-connector-config", '{"mode": "stagd"}'],
     "--kv-connector-config key 'mode' of connector 'nixl' must be one of direct, staged; got "
     "'stagd'"),
    (["--kv-connector", "nixl", "--kv-connector-config", '{"staging_slots": "4"}'],
     "--kv-connector-config key 'staging_slots' of connector 'nixl' must be an int >= 1; got "
     "'4'"),
    (["--mode", "colocated", "--kv-connector", "tcp"],
     "--kv-connector tcp has no effect with --mode colocated (one instance prefills and "
     "decodes: no KV moves); leave it out"),
    (["--role", "colocated", "--router-url", "tcp://h:1", "--layerwise-min-tokens", "0"],
     "--layerwise-min-tokens 0 has no effect with --role colocated (one instance prefills and "
     "decodes: no KV moves); leave it out"),
    (["--router-url", "tcp://127.0.0.1:5555"],
     "--router-url tcp://127.0.0.1:5555 is for an instance that joins a router (--role "
     "prefill, decode or colocated); --role all starts its own router: leave --router-url out"),
    (["--role", "router", "--router-url", "tcp://127.0.0.1:5555"],
     "--router-url tcp://127.0.0.1:5555 is for an instance that joins a router (--role "
     "prefill, decode or colocated); --role router starts its own router: leave --router-url out"),
    (["--role", "prefill", "--router-url", "tcp://x:99999"],
     "--router-url tcp://x:99999: port 99999 is not in 1..65535; use the control address the "
     "router printed"),
    (["--prefill-device", "3"],
     "--prefill-device 3 needs --device cuda (on cpu there is one device); leave it out or add "
     "--device cuda"),
    (["--decode-device", "0"],
     "--decode-device 0 needs --device cuda (on cpu there is one device); leave it out or add "
     "--device cuda"),
    (["--num-blocks", "1", "--memory-budget-mb", "8"],
     "give --num-blocks (1) or --memory-budget-mb (8), not both: --num-blocks sets the KV cache "
     "size, --memory-budget-mb sizes it by a profile run"),
    (["--device", "cuda", "--num-blocks", "1", "--gpu-memory-utilization", "0.5"],
     "give --num-blocks (1) or --gpu-memory-utilization (0.5), not both: --num-blocks sets the "
     "KV cache size, --gpu-memory-utilization sizes it by a profile run"),
    (["--host", "::1"],
     "--host ::1 is an IPv6 address; kvflow's ZMQ sockets listen on IPv4 only: use 127.0.0.1, "
     "0.0.0.0 or an IPv4 address of this host"),
])
def test_each_ignored_or_bad_combination_is_one_exact_line(argv, line):
    assert line_of(argv) == line


def test_a_kv_cache_larger_than_this_machine_names_num_blocks():
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_block = 2 * 4 * 2 * 32 * 16 * 4  # K and V x kvflow-tiny's 4 layers, 2 heads, dim 32; fp32
    n = have // per_block + 1
    assert line_of(["--mode", "colocated", "--num-blocks", str(n)]) == (
        f"--num-blocks {n} needs {n * per_block / 2**30:.1f} GiB of KV cache per instance "
        f"({per_block} bytes per block of kvflow-tiny) but this machine has {have / 2**30:.1f} GiB "
        f"of memory; lower --num-blocks, or leave it out to size the cache by a profile run from "
        f"--memory-budget-mb")
    assert parse_args(["--num-blocks", str(n - 1)]).num_blocks == n - 1


def test_a_float_write_timeout_is_taken_as_the_nixl_connector_takes_it():
    """issue 27: '{"write_timeout_s": 2.5}' was refused ("integer >= 1"); nixl takes any
    number > 0 seconds, and the flag check and the connector agree."""
    from kvflow.connector import make_sender
    from kvflow.layout import KVCacheSpec
    cfg = parse_args(["--kv-connector", "nixl", "--kv-connector-config",
                      '{"write_timeout_s": 2.5, "mode": "staged", "staging_slots": 2}'])
    assert cfg.kv_connector_config == {"write_timeout_s": 2.5, "mode": "staged",
                                       "staging_slots": 2}
    import torch
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    tx = make_sender(cfg.kv_connector, spec, config=cfg.kv_connector_config)
    assert (tx.timeout_s, tx.mode) == (2.5, "staged")
    assert parse_args(["--kv-connector", "nixl", "--kv-connector-config",
                       '{"write_timeout_s": 1}']).kv_connector_config == {"write_timeout_s": 1}


def test_layerwise_help_gives_each_kinds_default():
    """issue 27: --help said 16384 where nixl's default is 0; the text comes from the kinds."""
    action = {a.dest: a for a in build_parser()._actions}["layerwise_min_tokens"]
    assert action.help.endswith("(default: the connector's: 16384 (ipc-pull, ipc-push, tcp), "
                                "0 (nixl); docs/gpu_serving.md gives the measurements)")
