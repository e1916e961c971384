"""Each process's intra-op threads: the cores it may use divided by the node's ranks unless OMP_NUM_THREADS is set,
said in the start banner; the processes llmtune starts (--nproc, the demo's stages) given their share; the demo's
stages the same threads on 1 process as on 2, so that they are the same run bitwise."""

import os

import pytest
import torch

from llmtune.demo.run import stage_threads
from llmtune.run import threads
from llmtune.run.threads import CHOSEN, THREADS, launch_env, set_threads, usable_cores


@pytest.fixture
def no_thread_setting(monkeypatch):
    """A process started without OMP_NUM_THREADS (the suite's workers set it); torch's threads restored after."""
    for name in (THREADS, CHOSEN, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(before)


def test_the_cores_are_the_affinitys_with_a_cores_hyperthreads_counted_once(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    monkeypatch.setattr(threads.psutil, "cpu_count", lambda logical=True: 128 if logical else 64)
    assert usable_cores() == 4, "8 CPUs of a 64-core node with 2 hyperthreads a core"
    assert threads.threads_for(8) == 1 and threads.threads_for(3) == 1 and threads.threads_for(2) == 2


def test_a_process_takes_its_share_of_the_cores_and_says_so(no_thread_setting, monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert set_threads() == "4 per process (4 cores this process may use / 1 local rank; OMP_NUM_THREADS sets them)"
    assert torch.get_num_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert set_threads().startswith("2 per process (4 cores this process may use / 2 local ranks;")
    assert torch.get_num_threads() == 2


def test_the_users_setting_wins_and_is_named(no_thread_setting):
    no_thread_setting.setenv(THREADS, "1")
    torch.set_num_threads(1)  # what torch read from it when it started
    assert set_threads() == "1 per process (OMP_NUM_THREADS=1)"
    assert launch_env(2) == {}, "the user's value reaches the processes started"


def test_started_processes_get_their_share_and_the_reason(no_thread_setting, monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert launch_env(2) == {THREADS: "2", CHOSEN: "4 cores this process may use / 2 local ranks"}
    no_thread_setting.setenv(THREADS, "2")
    no_thread_setting.setenv(CHOSEN, "4 cores this process may use / 2 local ranks")
    torch.set_num_threads(2)
    assert set_threads() == "2 per process (4 cores this process may use / 2 local ranks)"


def test_the_demos_stages_take_the_same_threads_on_1_and_2_processes(no_thread_setting, monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr("llmtune.demo.run.usable_cores", lambda: 2)
    assert stage_threads(None) == stage_threads(1) == stage_threads(2)
    assert stage_threads(None)[THREADS] == "1"
    assert stage_threads(4)[THREADS] == "1"


def test_nprocs_workers_get_their_share_of_the_cores(no_thread_setting, monkeypatch):
    """launch_local hands torchrun's workers OMP_NUM_THREADS (torchrun would set 1) and the reason, for this launch
    alone."""
    from torch.distributed import run as torchrun

    from llmtune.run.launch import LOCAL_NPROC, launch_local

    for name in (LOCAL_NPROC, "HF_HUB_OFFLINE"):  # which launch_local sets for good: put back after the test
        monkeypatch.setenv(name, "")
    seen = {}
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(torchrun, "run", lambda args: seen.update({name: os.environ.get(name) for name in
                                                                   (THREADS, CHOSEN)}))
    assert launch_local(2, ["sft", "r.yaml"]) == 0
    assert seen == {THREADS: "4", CHOSEN: "8 cores this process may use / 2 local ranks"}
    assert THREADS not in os.environ and CHOSEN not in os.environ
