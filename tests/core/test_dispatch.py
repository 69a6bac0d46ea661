"""Dispatchers and collectors as pure functions, and their resolution through the plugin registries."""

from __future__ import annotations

import pytest
import torch

from rlcore import Batch, DispatcherSpec, NotRegistered, RlcoreError, function, load_plugins, worker
from rlcore.runtime import workers
from rlcore.runtime import dispatch as d
from rlcore.runtime.dispatch import Mesh

PLUGINS = load_plugins()


def test_slice_cuts_contiguous_near_equal_shards_and_replicates_the_rest():
    shards = d.dispatch_slice(3, ([1, 2, 3, 4, 5], "k"), {"xs": list("abcde"), "n": 7})
    assert shards == [
        (([1, 2], "k"), {"xs": ["a", "b"], "n": 7}),
        (([3, 4], "k"), {"xs": ["c", "d"], "n": 7}),
        (([5], "k"), {"xs": ["e"], "n": 7}),
    ]


def test_slice_skips_workers_whose_shard_is_empty():
    assert d.dispatch_slice(4, ([1, 2],), {}) == [(([1],), {}), (([2],), {}), None, None]
    assert d.dispatch_slice(2, ([],), {}) == [None, None]


def test_slice_cuts_batches_and_tensors_along_dim_0():
    batch = Batch(ids=torch.arange(5), text=list("abcde"))
    (a, _), (b, _) = d.dispatch_slice(2, (batch,), {})
    assert a[0]["text"] == ["a", "b", "c"] and b[0]["ids"].tolist() == [3, 4]
    (t0, _), (t1, _) = d.dispatch_slice(2, (torch.ones(3, 2),), {})
    assert t0[0].shape == (2, 2) and t1[0].shape == (1, 2)


def test_slice_refuses_list_arguments_of_different_lengths():
    with pytest.raises(RlcoreError, match=r"argument 0 has 3, argument 'stop' has 1"):
        d.dispatch_slice(2, ([1, 2, 3],), {"stop": ["</s>"]})


def test_mesh_rank_order_is_dp_then_pp_then_tp():
    mesh = Mesh(dp=2, tp=2, pp=2)
    assert [mesh.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)
    ]
    with pytest.raises(RlcoreError, match="Mesh.tp must be a positive int"):
        Mesh(dp=1, tp=0)


def test_dp_gives_one_shard_per_data_parallel_rank_replicated_over_tp():
    shards = d.dispatch_dp(4, (list(range(6)),), {}, Mesh(dp=2, tp=2))
    assert [s[0][0] for s in shards] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert shards[0] is shards[1]  # one shard object: the runtime sends it to the object store once
    with pytest.raises(RlcoreError, match=r"group of 4 workers but a mesh of 2"):
        d.dispatch_dp(4, ([1],), {}, Mesh(dp=2))


def test_a_callable_dispatcher_has_ms_swift_form_and_may_skip_workers():
    split = d.resolve_dispatcher(lambda n, i, data: None if i == 1 else ((data[i::n],), {}), PLUGINS).split
    assert split(3, ([0, 1, 2, 3, 4, 5],), {}, None) == [(([0, 3],), {}), None, (([2, 5],), {})]
    bad = d.resolve_dispatcher(lambda n, i, data: data, PLUGINS).split
    with pytest.raises(RlcoreError, match=r"must return \(args, kwargs\)"):
        bad(2, ([1],), {}, None)


def test_collectors():
    assert d.collect_none([1, 2]) == [1, 2]
    assert d.collect_first([3, 4]) == 3 and d.collect_first([]) is None
    assert d.collect_flatten([[1, 2], [3]]) == [1, 2, 3]
    assert d.collect_flatten([([1], ["a"]), ([2], ["b"])]) == ([1, 2], ["a", "b"])
    with pytest.raises(RlcoreError, match="result 1 is a int"):
        d.collect_flatten([[1], 2])
    assert d.collect_mean([1, 2, 6]) == 3.0
    assert d.collect_mean([{"loss": 1.0, "kl": 0.5}, {"loss": 3.0}]) == {"loss": 2.0, "kl": 0.5}
    with pytest.raises(RlcoreError, match="key 'x' is a str"):
        d.collect_mean([{"x": "a"}])
    assert torch.equal(d.collect_concat([torch.ones(2, 3), torch.zeros(1, 3)]), torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    joined = d.collect_concat([Batch(a=[1]), Batch(a=[2, 3])])
    assert isinstance(joined, Batch) and joined["a"] == [1, 2, 3]
    with pytest.raises(RlcoreError, match="use collect='flatten'"):
        d.collect_concat([[1], [2]])


def test_builtin_names_resolve_and_a_typo_says_did_you_mean():
    assert d.resolve_dispatcher("slice", PLUGINS).split is d.dispatch_slice
    assert d.resolve_collector("flatten", PLUGINS) is d.collect_flatten
    with pytest.raises(NotRegistered, match=r"dispatch 'slcie' is not registered; known: all, dp, .*slice\. Did you mean 'slice'\?"):
        d.resolve_dispatcher("slcie", PLUGINS)
    with pytest.raises(NotRegistered, match="Did you mean 'flatten'"):
        d.resolve_collector("flaten", PLUGINS)


def test_a_mode_pairs_its_dispatch_with_its_collect_and_the_ranks_collected():
    first = d.resolve("first", None, PLUGINS)  # rank 0 alone, collected with `first`
    assert first.split(3, (1,), {"k": 2}) == [((1,), {"k": 2}), None, None]
    assert first.collect is d.collect_first and first.kept(3, Mesh(dp=3)) is None
    assert d.resolve("first", "none", PLUGINS).collect is d.collect_none  # a named collect wins
    dp = d.resolve("dp", "concat", PLUGINS)  # one result per data-parallel shard: tensor rank 0, last stage
    assert dp.kept(8, Mesh(dp=2, tp=2, pp=2)) == {2, 6}
    assert d.resolve("slice", None, PLUGINS).collect is d.collect_none
    mine = DispatcherSpec("evens", lambda n, args, kwargs, mesh: [(args, kwargs)] * n, collect="flatten",
                          collect_ranks=lambda n, mesh: range(0, n, 2))
    mode = d.resolve(mine, None, PLUGINS)
    assert mode.collect is d.collect_flatten and mode.kept(5, Mesh(dp=5)) == {0, 2, 4}


PLUGIN = '''
from rlcore import CollectorSpec, DispatcherSpec, hookimpl

@hookimpl
def rlcore_dispatchers():
    yield DispatcherSpec("reversed", lambda n, args, kwargs, mesh: [((a[::-1],), kwargs) for a in [args[0]] * n])

@hookimpl
def rlcore_collectors():
    yield CollectorSpec("total", lambda results: sum(sum(r) for r in results))
'''


def test_a_plugin_dispatcher_and_collector_work_by_name(tmp_path):
    path = tmp_path / "reversing.py"
    path.write_text(PLUGIN)
    with workers.runtime(use_ray=False, plugins=load_plugins(extra=(str(path),))):  # the plugins workers use

        @worker(group="w")
        class Worker:
            @function(group="w", dispatch="reversed")
            def echo(self, xs):
                return xs

            @function(group="w", collect="total")
            def same(self, xs):
                return xs

        @worker(group="w")
        class Typo:
            @function(group="w", dispatch="reverse")
            def echo(self, xs):
                return xs

        w = Worker()
        assert w.echo([1, 2, 3]) == [[3, 2, 1]]
        assert w.same([1, 2, 3]) == 6
        with pytest.raises(NotRegistered, match="Did you mean 'reversed'"):
            Typo()  # names resolve when the class is built, before any worker starts
    with pytest.raises(NotRegistered, match="Worker.echo\\(\\): dispatch 'reversed' is not registered"):
        Worker()  # outside that runtime: the process's own plugins, which have no 'reversed'
