"""runners.choose(): one runner per Accelerator and process, from the environment detected once; the facade
asks it, and nothing else, where fn runs."""

from __future__ import annotations

import pickle

import pytest

from qaccel import Accelerator, SlurmCluster, options
from qaccel.environment import Environment, Kind, detect
from qaccel.launch import caller, cluster, in_place, runners
from qaccel.launch.protocol import HandBack

HAND_BACK = HandBack(in_place=lambda result: result, pickled=lambda obj: obj)
TORCHRUN = Environment(
    kind=Kind.TORCHRUN,
    rank=1,
    local_rank=1,
    world_size=2,
    local_world_size=2,
    master_addr="127.0.0.1",
    master_port=29500,
)


def _choose(env: Environment, **chosen) -> runners.Runner:
    return runners.choose(options.make_config(env, compute_setup="cpu", **chosen), env, HAND_BACK)


def test_a_plain_process_with_one_rank_runs_in_place_and_starts_nothing():
    runner = _choose(Environment(kind=Kind.PLAIN))
    assert isinstance(runner, in_place.InPlace) and not runner.starts_ranks
    assert runner.join() is None, "no launcher's ranks to join"
    assert (runner.planned().rank, runner.planned().world_size) == (0, 1)


def test_under_a_launcher_fn_runs_in_place_and_the_launchers_world_is_planned():
    runner = _choose(TORCHRUN, nprocs=2)
    assert isinstance(runner, in_place.InPlace) and not runner.starts_ranks and runner.launched
    assert (runner.planned().rank, runner.planned().world_size) == (1, 2)


def test_a_cluster_given_in_a_plain_process_is_a_cluster_job_and_ignored_under_a_launcher():
    job = SlurmCluster(nodes=2, tasks_per_node=1)
    assert isinstance(_choose(Environment(kind=Kind.PLAIN), nprocs=2, cluster=job), cluster.ClusterJob)
    assert isinstance(_choose(TORCHRUN, nprocs=2, cluster=job), in_place.InPlace), "the job's own tasks run in place"


def test_an_accelerator_chooses_once_and_again_in_the_process_that_unpickles_it(acc):
    assert isinstance(acc._runner, caller.PlainLaunch) and acc._runner.starts_ranks
    assert acc._where() is acc._where(), "chosen once"
    assert pickle.loads(pickle.dumps(acc))._runner is None, "a rank chooses for itself"
    inside = acc.distribute(lambda: type(acc._where()).__name__, all_results=True)()
    assert inside == ["InPlace", "InPlace"], "in a rank, fn runs in place (a nested distribute())"


def test_prepare_and_resume_in_the_caller_of_a_plain_launch_are_refused_naming_the_method_called(acc, tmp_path):
    with pytest.raises(RuntimeError, match=r"^prepare\(\) must run inside the function you distribute") as refused:
        acc.prepare(object())
    assert "every rank would get rank 0's shard" in str(refused.value)
    with pytest.raises(RuntimeError, match=r"^resume\(\) must run inside the function you distribute") as refused:
        acc.resume(tmp_path)
    assert "prepare()" not in str(refused.value) and "load its checkpoint" in str(refused.value)
    assert not any(tmp_path.iterdir()), "refused before it touched the folder"
    assert detect().kind == "plain"
    assert not Accelerator(compute_setup="cpu")._where().starts_ranks


def test_the_world_is_decided_once_by_the_environment_and_the_facade_says_whether_it_starts_ranks():
    """The launcher's world wins over nprocs wherever it is asked (the plan, the GPU check, the warning); a plain
    process's is nprocs, all on this node. acc.starts_ranks is the runner's answer, which the Trainer asks."""
    assert TORCHRUN.world(8) == (2, 2) and Environment(kind=Kind.PLAIN).world(3) == (3, 3)
    assert _choose(TORCHRUN, nprocs=8).planned().world_size == 2
    assert Accelerator(nprocs=2, compute_setup="cpu").starts_ranks
    assert not Accelerator(nprocs=1, compute_setup="cpu").starts_ranks
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    assert acc.distribute(lambda: acc.starts_ranks, all_results=True)() == [False, False], "a rank runs in place"
