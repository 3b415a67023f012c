"""Regressions planted by hand in the files the pair runs besides multi_connector.py, one a file or more,
each checked to turn a named contract red (issue 33: "a regression planted by hand in each of those files").

Each entry: the file (under site-packages), an exact snippet of the release's code, what replaces it, the
contracts expected to go red, and the deployment shape whose path it breaks (kvcompat.shapes).  The script
makes a hard-linked copy of the cell's venv (the cell's own venv never changes), and for each plant swaps the
file in the copy (a new file ``os.replace``-d over the path: the links are never written through), runs the
contracts' tests with the in-cell suite, restores the file, and prints one line:

    python3 docs/evidence/planted_regressions.py .kvcompat/venvs/<cell>   [--only NAME] [--shape FAMILY]

Exit status 1 if a planted regression left every expected contract green (the suite missed it).

Tried and dropped as equivalent on 0.34.0: removing SimpleCPUOffloadScheduler.reset()'s
``if self._abandoned_store_event_to_blocks or self._abandoned_reqs_to_load: return False``
(simple_kv_offload/manager.py:1529-1530) still refuses while a transfer is in flight, because the
blocks of an in-flight store or load are pinned and ``cpu_block_pool.reset_prefix_cache()``
(manager.py:1535) refuses for that reason too.  Dropping the Scheduler's
``cache_blocks`` once a remote load is ready (core/sched/scheduler.py:3650) leaves the received blocks
cached all the same: the request's next ``allocate_slots`` caches every full computed block
(core/kv_cache_manager.py:642-646), and an abort in between skips that call in the original too.
Turning the Scheduler's sub-block Mamba split off (``mamba_partial_cache_hit``, core/sched/scheduler.py:462-466)
leaves the hybrid-match-unit shape served to its last unit all the same: the release's Mamba layers export a
checkpoint inside the prefill (``num_prefill_checkpoint_blocks``), so no split is needed for the state there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KV = "vllm/distributed/kv_transfer/kv_connector"
NIXL = f"{KV}/v1/nixl"
SHAPE_READ = "test_shapes.py::test_pd_read_fills_each_rank_with_its_heads_and_nothing_else"


@dataclasses.dataclass(frozen=True)
class Plant:
    name: str
    file: str
    target: str
    replacement: str
    red: tuple[str, ...]  # test node ids (relative to tests/connectors) that must fail
    also: tuple[tuple[str, str], ...] = ()  # (target, replacement): the same change, spelled as other releases do
    shape: str = "dense"  # the deployment shape (kvcompat.shapes family) whose path the plant breaks


PLANTS = (
    Plant(
        "mla-drafts-split-draft-heads-in-any-layout",
        f"{NIXL}/base_worker.py",
        "            has_draft_regions\n            and draft_remote_heads != draft_local_heads\n            and (\n",
        "            False\n            and draft_remote_heads != draft_local_heads\n            and (\n",
        (
            "test_shape_mla_drafts.py::"
            "test_a_split_draft_pair_in_the_default_layout_is_served_or_refused_naming_the_layout",
        ),
        shape="mla-drafts",
    ),
    Plant(
        "nixl-abort-before-scheduling-strands-prefill",
        f"{NIXL}/pull_scheduler.py",
        "            self._reqs_need_recv[request.request_id] = (request, [], (), False)\n",
        "",
        ("test_nixl_child.py::test_decode_abort_before_scheduling_releases_the_prefill_blocks",),
    ),
    Plant(
        "nixl-decode-ignores-local-prefix-hit",
        f"{NIXL}/pull_scheduler.py",
        "            count = actual - num_computed_tokens\n",
        "            count = actual\n",
        ("test_nixl_child.py::test_decode_with_a_local_prefix_hit_reads_only_the_uncached_suffix",),
    ),
    Plant(
        "nixl-worker-lease-never-expires",
        f"{NIXL}/base_worker.py",
        "req_id for req_id, expires in self._reqs_to_send.items() if now >= expires",
        "req_id for req_id, expires in self._reqs_to_send.items() if now >= expires + 3600",
        ("test_nixl_child.py::test_prefill_frees_the_blocks_when_the_lease_expires",),
    ),
    Plant(
        "offload-store-done-after-one-rank",
        "vllm/v1/simple_kv_offload/manager.py",
        "            if total >= self._expected_worker_count:\n",
        "            if total >= 1:\n",
        ("test_tp_ranks.py::test_a_store_counts_only_when_both_ranks_have_stored",),
    ),
    Plant(
        "offload-load-keeps-cpu-blocks-pinned",
        "vllm/v1/simple_kv_offload/manager.py",
        "            # Free CPU touch refs\n            self.cpu_block_pool.free_blocks(\n",
        "            # Free CPU touch refs\n            (lambda blocks: None)(\n",
        ("test_cpu_tier.py::test_cpu_tier_load_is_asynchronous_and_unpins_when_it_completes",),
    ),
    Plant(
        "offload-connector-reset-raises",
        f"{KV}/v1/simple_cpu_offload_connector.py",
        "            return self.scheduler_manager.reset()\n",
        "            return self.scheduler_manager.reset_all()\n",
        ("test_cpu_tier.py::test_reset_cache_on_an_idle_engine_answers_and_reaches_both_children",),
    ),
    Plant(
        "scheduler-aborted-load-blocks-not-freed",
        "vllm/v1/core/sched/scheduler.py",
        "                self._aborted_kv_loads.discard(req_id)\n                self._free_blocks(self.requests[req_id])\n",
        "                self._aborted_kv_loads.discard(req_id)\n",
        ("test_nixl_child.py::test_decode_abort_while_waiting_for_remote_kv_releases_both_sides",),
        also=(
            (
                "                assert RequestStatus.is_finished(req.status)\n"
                "                self._free_blocks(self.requests[req_id])\n",
                "                assert RequestStatus.is_finished(req.status)\n",
            ),
        ),
    ),
    Plant(
        "scheduler-finished-sending-not-freed",
        "vllm/v1/core/sched/scheduler.py",
        '"Finished sending KV transfer for request %s", req_id)\n'
        "            assert req_id in self.requests\n            self._free_blocks(self.requests[req_id])\n",
        '"Finished sending KV transfer for request %s", req_id)\n            assert req_id in self.requests\n',
        ("test_nixl_child.py::test_decode_waits_for_the_remote_kv_and_asks_for_exactly_the_prefilled_tokens",),
    ),
    Plant(
        "aggregator-finishes-on-the-first-rank",
        f"{KV}/utils.py",
        "                if remaining_count_dict[req_id] == 0:\n",
        "                if remaining_count_dict[req_id] < self._expected_finished_count:\n",
        (
            "test_tp_ranks.py::test_a_send_finishes_only_when_both_ranks_have_been_read",
            "test_tp_ranks.py::test_a_load_finishes_only_when_both_ranks_have_loaded",
        ),
    ),
    Plant(
        "aggregator-keeps-the-first-ranks-invalid-blocks",
        f"{KV}/utils.py",
        "            invalid_block_ids |= kv_output.invalid_block_ids\n",
        "            invalid_block_ids |= set() if invalid_block_ids else kv_output.invalid_block_ids\n",
        ("test_tp_ranks.py::test_blocks_failed_on_different_ranks_all_reach_the_scheduler_and_are_recomputed",),
    ),
    # -- deployment shapes (tests/connectors/test_shapes.py and test_shape_*.py) --------------------------
    Plant(
        "hetero-tp-every-decode-rank-reads-the-first-head",
        f"{NIXL}/tp_mapping.py",
        "    return tp_rank % (tp_size // remote_tp_size)\n",
        "    return 0\n",
        (f"{SHAPE_READ}[hetero-tp-p1d2]",),
        shape="hetero-tp",
    ),
    Plant(
        "hetero-tp-replicated-heads-read-at-the-wrong-offset",
        f"{NIXL}/tp_mapping.py",
        "        return local_head - remote_head\n",
        "        return tp_rank % 2\n",
        (f"{SHAPE_READ}[hetero-tp-p1d4]",),
        shape="hetero-tp",
    ),
    Plant(
        "hetero-tp-prefill-frees-after-one-reader",
        f"{KV}/utils.py",
        "        return max(1, self.tp_ratio(remote_tp_size))\n",
        "        return 1\n",
        (
            "test_shape_hetero_tp.py::test_the_prefill_frees_a_request_only_when_every_reading_rank_has_read[hetero-tp-p1d2]",
        ),
        shape="hetero-tp",
    ),
    Plant(
        "hetero-tp-decode-reads-one-of-two-prefill-ranks",
        f"{NIXL}/tp_mapping.py",
        "        attn_ranks = (start + np.sort(unique_idx)).tolist()\n",
        "        attn_ranks = [start]\n",
        (
            f"{SHAPE_READ}[hetero-tp-p2d1]",
            "test_shape_hetero_tp.py::test_each_decode_rank_reads_its_heads_from_the_prefill_ranks_that_hold_them[hetero-tp-p2d1]",
        ),
        shape="hetero-tp",
    ),
    Plant(
        "mla-replicated-latent-read-one-block-on",
        f"{NIXL}/base_worker.py",
        "                num_reads, rank_offset = 1, 0\n",
        "                num_reads, rank_offset = 1, block_strides[i]\n",
        (f"{SHAPE_READ}[mla]", f"{SHAPE_READ}[mla-p2d1]"),
        shape="mla",
    ),
    Plant(
        "mla-unread-prefill-ranks-never-told",
        f"{NIXL}/pull_worker.py",
        "        if self.use_mla and tp_ratio < 0 and len(read_specs) == 1:\n",
        "        if self.use_mla and tp_ratio < 0 and len(read_specs) == 0:\n",
        (
            "test_shape_mla.py::test_decode_reads_the_replicated_latent_once_and_every_prefill_rank_frees_it_promptly[mla-p2d1]",
        ),
        shape="mla",
    ),
    Plant(
        "mla-drafts-draft-heads-read-at-the-latents-mapping",
        f"{NIXL}/base_worker.py",
        "                    if local_region in self._head_sharded_draft_regions\n",
        "                    if False  # PLANTED: the draft's heads read with the MLA latent's TP mapping\n",
        (
            "test_shape_mla_drafts.py::test_pd_read_gives_decode_the_latent_and_its_draft_heads_and_every_prefill"
            "_rank_frees_promptly[mla-eagle-p1d2]",
        ),
        shape="mla-drafts",
    ),
    Plant(
        "restarted-prefill-replaced-engine-never-released",
        f"{NIXL}/base_worker.py",
        "            replaced = self._remote_agents.keys() - self._engine_by_address.values()\n",
        "            replaced = set()\n",
        (
            "test_shape_restarted.py::test_decode_handshakes_the_new_prefill_before_reading_and_lets_go_of_the_old_one"
            "[restarted-prefill]",
        ),
        shape="restarted-prefill",
    ),
    Plant(
        "restarted-prefill-dead-peer-never-invalidated",
        f"{NIXL}/base_worker.py",
        "                if not all(map(self.nixl_wrapper.check_remote_metadata, agents)):\n"
        "                    self._mark_remote_engine_invalid(engine_id, now)\n",
        "                if not all(map(self.nixl_wrapper.check_remote_metadata, agents)):\n                    pass\n",
        (
            "test_shape_restarted.py::test_a_prefill_restarted_with_its_engine_id_is_never_read_with_the_old_engines"
            "_addresses[restarted-prefill]",
        ),
        shape="restarted-prefill",
    ),
    Plant(
        "hybrid-ssm-state-read-four-bytes-on",
        f"{NIXL}/base_worker.py",
        "(base_addr + conv_size, ssm_size, device_id, block_stride, num_blocks)",
        "(base_addr + conv_size + 4, ssm_size, device_id, block_stride, num_blocks)",
        (
            f"{SHAPE_READ}[hybrid]",
            "test_shape_hybrid.py::test_hybrid_pd_decode_continues_exactly_as_one_engine[hybrid]",
        ),
        shape="hybrid",
    ),
    Plant(
        "hybrid-one-sliding-window-block-too-few",
        f"{NIXL}/base_scheduler.py",
        "blocks = blocks[-n_sw:]",
        "blocks = blocks[-n_sw + 1 :]",
        (f"{SHAPE_READ}[hybrid]",),
        shape="hybrid",
    ),
    Plant(
        "hybrid-failed-hma-read-reported-received",
        f"{NIXL}/base_worker.py",
        "            failed_recving=failed_recv_reqs,\n",
        "            failed_recving=set() if self._is_hma_required else failed_recv_reqs,\n",
        (
            "test_shape_hybrid.py::test_a_failed_hybrid_read_fails_the_request_or_recomputes_it_never_decodes"
            "_unwritten_blocks[hybrid]",
        ),
        shape="hybrid",
    ),
    Plant(
        "hybrid-cpu-tier-restores-only-full-attention",
        "vllm/v1/simple_kv_offload/manager.py",
        "            g_block_size = self.group_block_sizes[g]\n            gpu_ext_start = num_computed_tokens // g_block_size\n",
        "            if g != self.fa_gidx:\n                continue\n"
        "            g_block_size = self.group_block_sizes[g]\n            gpu_ext_start = num_computed_tokens // g_block_size\n",
        (
            "test_shape_hybrid.py::test_a_cpu_tier_hit_restores_every_kv_cache_group[hybrid]",
            "test_shape_hybrid.py::test_a_prompt_whose_shared_prefix_the_device_holds_without_its_state_is_served"
            "_whole_from_the_cpu_tier[hybrid]",
        ),
        shape="hybrid",
    ),
    Plant(
        "hybrid-state-block-unpinned-while-stored",
        "vllm/v1/simple_kv_offload/manager.py",
        "                in_flight.add(gpu_block_id)\n                gpu_block_pool.touch([gpu_block])\n",
        "                in_flight.add(gpu_block_id)\n",
        ("test_shape_hybrid.py::test_a_state_block_being_stored_stays_pinned_until_its_store_completes[hybrid]",),
        shape="hybrid",
    ),
    Plant(
        "hybrid-match-unit-cpu-tier-hits-whole-blocks-only",
        "vllm/v1/simple_kv_offload/manager.py",
        "            allow_partial_hash_hits=not lazy_offload,\n",
        "            allow_partial_hash_hits=False,  # PLANTED: the CPU tier looks up whole blocks only\n",
        (
            "test_shape_hybrid.py::test_a_prompt_sharing_part_of_a_block_with_a_stored_one_is_served_to_the_last"
            "_shared_unit[hybrid-match-unit]",
        ),
        shape="hybrid",
    ),
    Plant(
        "drafts-no-room-for-the-first-speculative-step",
        "vllm/v1/core/sched/scheduler.py",
        "                        + self._spec_decode_step_blocks\n",
        "                        + 0  # PLANTED: no room kept for the speculative step after the load\n",
        (
            "test_shape_drafts.py::test_an_async_load_is_admitted_only_when_its_first_speculative_step_fits[drafts-ngram]",
        ),
        shape="drafts",
    ),
    Plant(
        "drafts-padded-step-allocates-one-token",
        "vllm/v1/core/sched/scheduler.py",
        "                num_tokens_past_hit = max(num_new_tokens - num_replay_tokens, 0)\n",
        "                num_tokens_past_hit = max((1 if pad_spec_decode else num_new_tokens) - num_replay_tokens, 0)  # PLANTED\n",
        (
            "test_shape_drafts.py::test_a_request_resumed_after_an_async_load_gets_the_slots_of_its_first_speculative_step[drafts-ngram-nixl]",
        ),
        shape="drafts",
    ),
    Plant(
        "drafts-rejected-tokens-stay-computed",
        "vllm/v1/core/sched/scheduler.py",
        "                        request.num_computed_tokens -= num_rejected\n",
        "                        pass  # PLANTED: rejected drafts stay counted as computed\n",
        (f"{SHAPE_READ}[drafts-ngram]",),
        shape="drafts",
    ),
    Plant(
        "async-placeholders-never-resolved",
        "vllm/v1/core/sched/scheduler.py",
        "            request.num_output_placeholders -= num_new_tokens\n",
        "            request.num_output_placeholders -= 0  # PLANTED: async placeholders never resolved\n",
        (
            "test_shape_async.py::test_pd_and_cpu_tier_hits_give_the_same_kv_and_tokens_as_with_async_scheduling_off[async-sched-dense]",
        ),
        shape="async-sched",
    ),
    Plant(
        "async-blocks-freed-under-a-step-in-flight",
        "vllm/v1/core/sched/scheduler.py",
        "        return not self.defer_block_free or (\n            request.last_sched_seq <= self.processed_step_seq\n        )\n",
        "        return True  # PLANTED: free a finished request's blocks while a step in flight still writes them\n",
        (
            "test_shape_async.py::test_a_kv_load_never_lands_in_a_block_a_step_in_flight_still_writes[async-sched-dense]",
        ),
        shape="async-sched",
    ),
)


def _swap(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)


@contextlib.contextmanager
def venv_copy(cell_venv: Path, prefix: str):
    """A hard-linked copy of a cell's venv, for as long as the block runs: a file is changed only by replacing it in
    the copy (``_swap``: os.replace, never written through a link), so the cell's own venv, which a matrix run or a
    mutation session may be using, never changes."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run(["cp", "-al", str(cell_venv.resolve()), str(venv)], check=True)
        yield venv


def run(venv: Path, plant: Plant, repo: Path) -> tuple[bool, str]:
    site = next(venv.glob("lib/python3*/site-packages"))
    path = site / plant.file
    pristine = path.read_text()
    spellings = [(plant.target, plant.replacement), *plant.also]
    found = [(t, r) for t, r in spellings if pristine.count(t) == 1]
    if len(found) != 1:
        return (
            False,
            f"{len(found)} of its spellings found once in {plant.file} (this release's code differs): not planted",
        )
    target, replacement = found[0]
    planted = pristine.replace(target, replacement)
    try:
        compile(planted, plant.file, "exec")
    except SyntaxError as exc:
        return False, f"the planted file does not compile ({exc.msg}, line {exc.lineno}): fix the plant"
    try:
        _swap(path, planted)
        tests = [f"tests/connectors/{t}" for t in plant.red]
        cmd = [str(venv / "bin/python"), "-m", "pytest", *tests, "-p", "no:cacheprovider", "-q", "--tb=line"]
        env = dict(os.environ, PYTHONPATH=str(repo / "src"))
        out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600).stdout
        failed = [t for t in plant.red if f"FAILED tests/connectors/{t}" in out or f"ERROR tests/connectors/{t}" in out]
        summary = out.strip().splitlines()[-1] if out.strip() else "no output"
        return bool(failed), f"red: {', '.join(t.split('::')[1] for t in failed) or 'none'} ({summary})"
    finally:
        _swap(path, pristine)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("venv", type=Path, help="a cell's venv, e.g. .kvcompat/venvs/<cell>")
    ap.add_argument("--only", action="append", default=[], help="a plant's name (repeatable)")
    ap.add_argument("--shape", action="append", default=[], help="only the plants of this shape family (repeatable)")
    args = ap.parse_args()
    if not (args.venv / "bin/python").exists():
        print(f"error: {args.venv} is not a cell venv (no bin/python); run the cell first", file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parents[2]
    missed = 0
    with venv_copy(args.venv, "kvcompat-plant-") as venv:
        for plant in PLANTS:
            picked = plant.name in args.only or plant.shape in args.shape
            if (args.only or args.shape) and not picked:
                continue
            ok, line = run(venv, plant, repo)
            missed += not ok
            where = f"{plant.shape}, {plant.file.rsplit('/', 1)[-1]}"
            print(f"{'KILLED ' if ok else 'MISSED '} {plant.name} [{where}]: {line}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
