"""Launch habits people bring (pure): torchrun's and horovodrun's spellings, the per-node
mode, the variables PyTorch programs read, and each worker's own GPUs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from akv.errors import LaunchError
from akv.launch.args import LaunchOptions, parse_args
from akv.launch.devices import parse_nvidia_smi, visible_devices, worker_devices
from akv.launch.hosts import Host, node_share
from akv.launch.plans import JobContext, plan
from tests.akv.launch.support import ENV, TOKEN

TORCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
NVIDIA_SMI = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0c1d)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-77aa)
  MIG 3g.40gb     Device  0: (UUID: MIG-5e1f)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-b2c3)
"""


def context(**changes) -> JobContext:
    facts = JobContext(
        environ={**ENV, "RANK": "7", "LOCAL_RANK": "3"},
        token=TOKEN,
        cwd="/w",
        python="/py",
        scheduler_port=4242,
        scheduler_fd=7,
    )
    return replace(facts, **changes)


# ------------------------------------------------------------------ spellings


@pytest.mark.parametrize(
    "argv",
    [
        ["-np", "3", "python", "t.py"],
        ["-n", "3", "python", "t.py"],
        ["--nproc-per-node", "3", "python", "t.py"],
        ["--nproc_per_node=3", "python", "t.py"],
        ["-n", "3", "--nproc-per-node", "3", "python", "t.py"],
    ],
)
def test_torchrun_and_horovodrun_spellings_give_the_number_of_workers(argv):
    options = parse_args(argv)
    assert (options.num_workers, options.num_servers, options.nnodes) == (3, 3, None)
    assert options.command == ("python", "t.py")


def test_the_per_node_mode_takes_torchruns_flags():
    argv = "--nnodes 2 --node_rank 1 --master_addr n0 --master_port 7000 --nproc_per_node 4"
    options = parse_args([*argv.split(), "python", "t.py"])
    assert (options.num_workers, options.num_servers) == (8, 2)  # a server per node
    assert (options.nnodes, options.node_rank, options.scheduler) == (2, 1, "n0:7000")
    assert math.isinf(options.grace_s)  # node 0's scheduler stops when the whole job ended
    assert parse_args(["--nnodes", "1", "--master-addr", "::1", "-n", "1", "x"]).scheduler == (
        "[::1]:29500"
    )
    assert parse_args(["--nnodes", "1", "--scheduler", "n0:9", "-n", "1", "x"]).scheduler == "n0:9"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["x"], r"missing -n/--num-workers WORKERS \(or -np WORKERS, or --nproc-per-node N\)"),
        (["-n", "3", "--nproc-per-node", "2", "x"], "-n 3 contradicts --nproc-per-node 2 on 1"),
        (["--nproc-per-node", "0", "x"], "--nproc-per-node is 0"),
        (["-n", "2", "--nnodes", "2", "--scheduler", "h:1", "x"], "needs --node-rank K"),
        (["-n", "2", "--nnodes", "2", "--node-rank", "2", "--scheduler", "h:1", "x"], "0..1"),
        (["-n", "2", "--nnodes", "2", "--node-rank", "0", "x"], "needs the scheduler's address"),
        (["-n", "1", "--nnodes", "1", "--scheduler", "h", "x"], "give HOST:PORT"),
        (["-n", "1", "--nnodes", "1", "--scheduler", "0.0.0.0:1", "x"], "wildcard address"),
        (["-n", "1", "--nnodes", "2", "--node-rank", "0", "--scheduler", "h:1", "x"], "at least"),
        (["-n", "1", "--node-rank", "1", "x"], "--node-rank is for the per-node mode"),
        (["-n", "1", "--master-addr", "h", "x"], "--scheduler/--master-addr is for the per-node"),
        (["-n", "1", "--master-port", "9", "x"], "--master-port needs --master-addr"),
        (["-n", "1", "--scheduler", "a:1", "--master-addr", "b", "x"], "give one of them"),
        (
            ["-n", "1", "--nnodes", "1", "--scheduler", "h:1", "--launcher", "ssh", "-H", "f", "x"],
            "takes no --launcher ssh",
        ),
        (["-n", "1", "--gpus-per-worker", "two", "x"], "--gpus-per-worker 'two'"),
        (["-n", "1", "--gpus-per-worker", "-1", "x"], "give a number >= 0, or `all`"),
        (
            [
                "-n",
                "1",
                "--gpus-per-worker",
                "1",
                "--launcher",
                "slurm",
                "--scheduler-host",
                "h",
                "x",
            ],
            "give them their devices with srun's",
        ),
        (
            ["-n", "1", "--gpus-per-worker", "1", "--env", "CUDA_VISIBLE_DEVICES=0", "--", "x"],
            "both choose the workers' GPUs",
        ),
        (["-n", "1", "--log-level", "loud", "x"], "--log-level='loud' is not a log level"),
        (["-n", "1", "--log-level", "info", "--env", "AKV_LOG_LEVEL=debug", "--", "x"], "one of"),
        (["-n", "1", "--env", "RANK=3", "--", "x"], "akv-launch sets RANK itself"),
        (["-n", "1", "--env", "AKV_RANK_FROM=hostname-ordinal", "--", "x"], "sets AKV_RANK_FROM"),
    ],
)
def test_launch_habits_that_cannot_work_are_refused_naming_the_flag(argv, message):
    with pytest.raises(LaunchError, match=message):
        parse_args(argv)


# ------------------------------------------------------------------ what workers get


def test_local_workers_get_the_variables_pytorch_programs_read():
    specs = plan(LaunchOptions(2, 1, ("python", "t.py")), context())
    workers = [spec for spec in specs if spec.role == "worker"]
    assert [tuple(w.env[name] for name in TORCH) for w in workers] == [
        ("0", "2", "0", "2", "127.0.0.1", "4243"),
        ("1", "2", "1", "2", "127.0.0.1", "4243"),
    ]
    for spec in specs:  # the launcher's own RANK (an outer torchrun's) never leaks in
        if spec.role != "worker":
            assert not set(TORCH) & set(spec.env)
    assert all("CUDA_VISIBLE_DEVICES" not in spec.env for spec in specs)  # no GPU here


def test_env_may_point_master_port_elsewhere():
    options = LaunchOptions(1, 1, ("x",), env={"MASTER_PORT": "29600"})
    assert plan(options, context())[-1].env["MASTER_PORT"] == "29600"


def test_each_local_worker_gets_its_share_of_this_machines_gpus():
    def devices(workers: int, gpus: list[str], **changes) -> list[str | None]:
        options = replace(LaunchOptions(workers, 1, ("x",)), **changes)
        specs = plan(options, context(gpus=gpus))
        return [s.env.get("CUDA_VISIBLE_DEVICES") for s in specs if s.role == "worker"]

    assert devices(2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert devices(2, ["0", "1", "2", "3"], gpus_per_worker=1) == ["0", "1"]
    assert devices(3, ["4", "6"]) == ["4", "6", "4"]  # fewer GPUs than workers: they share
    assert devices(2, ["0", "1"], gpus_per_worker="all") == [None, None]
    assert devices(2, ["0", "1"], gpus_per_worker=0) == ["", ""]
    assert devices(2, ["0"], env={"CUDA_VISIBLE_DEVICES": "0"}) == ["0", "0"]  # the user's
    with pytest.raises(LaunchError, match="needs 4 GPUs; it has 2 \\(0, 1\\)"):
        devices(2, ["0", "1"], gpus_per_worker=2)


def test_ssh_workers_are_ranked_per_host_and_master_is_worker_0s_host():
    hosts = [Host("a", slots=1), Host("b", slots=2)]
    options = LaunchOptions(3, 1, ("x",), launcher="ssh", hostfile="h", scheduler_host="me")
    options = replace(options, gpus_per_worker=1)
    workers = [s for s in plan(options, context(hosts=hosts)) if s.role == "worker"]
    # server 0 on a, then workers: b, b, a (round-robin with slots)
    assert [w.host for w in workers] == ["b", "b", "a"]
    assert [(w.job_env["LOCAL_RANK"], w.job_env["LOCAL_WORLD_SIZE"]) for w in workers] == [
        ("0", "2"),
        ("1", "2"),
        ("0", "1"),
    ]
    assert {w.job_env["MASTER_ADDR"] for w in workers} == {"b"}
    assert [w.job_env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0", "1", "0"]
    assert all("export RANK=" in (w.stdin or "") for w in workers)


def test_an_mpi_or_slurm_group_gets_only_world_size():
    options = LaunchOptions(4, 1, ("x",), launcher="slurm", scheduler_host="h0")
    workers = plan(options, context())[-1]
    assert workers.env["WORLD_SIZE"] == "4"
    assert not {"RANK", "LOCAL_RANK", "MASTER_ADDR"} & set(workers.job_env)


@pytest.mark.parametrize(
    ("total", "nodes", "shares"),
    [(7, 3, [range(0, 3), range(3, 5), range(5, 7)]), (2, 2, [range(0, 1), range(1, 2)])],
)
def test_each_node_runs_a_block_of_ranks(total, nodes, shares):
    assert [node_share(total, nodes, node) for node in range(nodes)] == shares
    assert [len(node_share(1, 2, node)) for node in range(2)] == [1, 0]


def test_per_node_plans_split_the_job_and_node_0_runs_the_scheduler():
    options = LaunchOptions(4, 2, ("x",), nnodes=2, node_rank=0, scheduler="n0:7000")
    facts = context(scheduler_port=7000, node_host="10.0.0.1", gpus=["0", "1"])
    node0 = plan(options, facts)
    assert [(s.role, s.rank) for s in node0] == [
        ("scheduler", None),
        ("server", 0),
        ("worker", 0),
        ("worker", 1),
    ]
    scheduler, server, *workers = node0
    assert scheduler.env["AKV_SCHEDULER_HOST"] == "0.0.0.0"  # listens everywhere
    assert server.env["AKV_HOST"] == "10.0.0.1"
    for worker in workers:
        assert (worker.env["AKV_SCHEDULER_HOST"], worker.env["AKV_SCHEDULER_PORT"]) == (
            "n0",
            "7000",
        )
        assert (worker.env["MASTER_ADDR"], worker.env["MASTER_PORT"]) == ("n0", "7001")
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0", "1"]
    node1 = plan(replace(options, node_rank=1, node_host="node1.example"), facts)
    assert [(s.role, s.rank) for s in node1] == [("server", 1), ("worker", 2), ("worker", 3)]
    assert node1[0].env["AKV_HOST"] == "node1.example"
    assert [(w.env["RANK"], w.env["LOCAL_RANK"]) for w in node1[1:]] == [("2", "0"), ("3", "1")]


# ------------------------------------------------------------------ devices


def test_nvidia_smi_lists_gpus_and_cuda_visible_devices_wins():
    assert parse_nvidia_smi(NVIDIA_SMI) == ["0", "1", "2"]
    assert visible_devices({}, NVIDIA_SMI) == ["0", "1", "2"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-77aa, 3"}, NVIDIA_SMI) == ["GPU-77aa", "3"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, NVIDIA_SMI) == []
    assert visible_devices({}, None) == []


def test_worker_devices_on_another_machine_are_numbered_from_0():
    assert worker_devices(None, 2, 2) == ["0,1", "2,3"]
    assert worker_devices(None, 2, None) == [None, None]
    assert worker_devices([], 2, None) == [None, None]
