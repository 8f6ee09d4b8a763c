"""LeRobot-v3-style datasets: record -> load -> inspect, SFT batch sampling, validation errors."""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from services.envs.datasets import iter_batches, record
from services.envs.sims import REACH2D_ID, make_env
from services.envs.sims.reach import scripted_expert
from tests.helpers import ROOT
from vla.data import (
    DatasetError,
    EpisodeRecord,
    check_dataset,
    inspect,
    load_dataset,
    write_dataset,
)

DATA = "data/chunk-000/file-000.parquet"
IMAGE_KEY = "observation.images.front"
EPISODES, SEED, SIZE = 6, 3, 32


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("datasets") / "reach"
    record(REACH2D_ID, EPISODES, root, seed=SEED, env_kwargs={"image_size": SIZE})
    return root


def _replay(episode: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], str]:
    """Re-run the expert in episode ``episode`` of the recorded dataset, frame by frame."""
    env = make_env(REACH2D_ID, image_size=SIZE)
    obs, _ = env.reset(seed=SEED + episode)
    images, states, actions = [], [], []
    instruction = obs["instruction"]
    while True:
        action = scripted_expert(env)
        images.append(obs["image"])
        states.append(obs["state"])
        actions.append(action)
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            return images, states, actions, instruction


def test_record_load_inspect_round_trip(recorded: Path) -> None:
    for rel in ("meta/info.json", "meta/tasks.parquet", "meta/episodes.parquet", DATA):
        assert (recorded / rel).is_file(), rel
    info = json.loads((recorded / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10
    assert info["camera_keys"] == [IMAGE_KEY]
    assert info["features"]["observation.state"]["shape"] == [4]
    assert info["features"]["action"]["shape"] == [2]
    assert info["features"][IMAGE_KEY] == {
        "dtype": "image",
        "shape": [SIZE, SIZE, 3],
        "names": ["height", "width", "channels"],
    }
    schema = pq.read_schema(recorded / DATA)
    assert schema.field("observation.state").type == pa.list_(pa.float32(), 4)
    assert schema.field("action").type == pa.list_(pa.float32(), 2)
    assert schema.field(IMAGE_KEY).type == pa.binary()

    ds = load_dataset(recorded)
    assert ds.num_episodes == EPISODES == info["total_episodes"]
    assert len(ds) == info["total_frames"]
    for ep in ds.episodes:
        images, states, actions, instruction = _replay(ep.episode_index)
        rows = np.arange(ep.from_index, ep.to_index)
        assert ep.length == len(actions) and ep.task == instruction and ep.success is True
        np.testing.assert_array_equal(ds.images(rows)[:, 0], np.stack(images))
        np.testing.assert_array_equal(ds.state_N_S[rows], np.stack(states))
        np.testing.assert_array_equal(ds.action_N_A[rows], np.stack(actions))
        np.testing.assert_array_equal(ds.frame_index_N[rows], np.arange(ep.length))
        assert {ds.tasks[t] for t in ds.task_index_N[rows]} == {instruction}

    # The PNGs are ordinary PNGs: Pillow reads them to the same pixels.
    png = pq.read_table(recorded / DATA).column(IMAGE_KEY)[0].as_py()
    pillow = np.asarray(Image.open(io.BytesIO(png)))
    np.testing.assert_array_equal(pillow, ds.images(np.array([0]))[0, 0])

    summary = inspect(recorded)
    assert (summary.total_episodes, summary.total_frames) == (EPISODES, len(ds))
    assert summary.success_rate == 1.0
    assert summary.action_min == pytest.approx(ds.action_N_A.min(axis=0).tolist())
    assert summary.action_max == pytest.approx(ds.action_N_A.max(axis=0).tolist())
    assert summary.action_mean == pytest.approx(ds.action_N_A.mean(axis=0).tolist())
    assert sum(task.episodes for task in summary.tasks) == EPISODES
    text = summary.format()
    for needle in (f"episodes  {EPISODES}", f"frames {len(ds)}", "fps 10", "success   100.0%"):
        assert needle in text
    assert f"{IMAGE_KEY}" in text and f"({SIZE}, {SIZE}, 3)" in text
    assert all(repr(task.task) in text for task in summary.tasks)


def test_recording_is_reproducible_from_the_seed(recorded: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    record(REACH2D_ID, EPISODES, again, seed=SEED, env_kwargs={"image_size": SIZE})
    assert pq.read_table(again / DATA).equals(pq.read_table(recorded / DATA))
    with pytest.raises(FileExistsError):
        record(REACH2D_ID, 1, again, seed=SEED)
    record(REACH2D_ID, 2, again, seed=SEED, max_steps=3, overwrite=True)
    assert [ep.length for ep in load_dataset(again).episodes] == [3, 3]


def _synthetic(lengths: list[int], seed: int = 0) -> list[EpisodeRecord]:
    rng = np.random.default_rng(seed)
    return [
        EpisodeRecord(
            task=f"task {i % 2}",
            state_T_S=rng.normal(size=(n, 3)).astype(np.float32),
            action_T_A=rng.uniform(-1, 1, size=(n, 5)).astype(np.float32),
            images={
                cam: rng.integers(0, 256, size=(n, 8, 12, 3), dtype=np.uint8)
                for cam in ("front", "wrist")
            },
            success=None,
        )
        for i, n in enumerate(lengths)
    ]


def test_write_dataset_rolls_files_and_load_joins_them(tmp_path: Path) -> None:
    lengths = [4, 7, 3, 9, 5]
    episodes = _synthetic(lengths)
    info = write_dataset(tmp_path / "ds", episodes, fps=30, frames_per_file=10)
    assert info.total_frames == sum(lengths)
    files = sorted(p.name for p in (tmp_path / "ds/data/chunk-000").iterdir())
    assert files == ["file-000.parquet", "file-001.parquet", "file-002.parquet"]

    ds = load_dataset(tmp_path / "ds")
    assert ds.camera_keys == ("observation.images.front", "observation.images.wrist")
    np.testing.assert_array_equal(ds.state_N_S, np.concatenate([e.state_T_S for e in episodes]))
    np.testing.assert_array_equal(ds.action_N_A, np.concatenate([e.action_T_A for e in episodes]))
    images_N_V_H_W_3 = ds.images(np.arange(len(ds)))
    for v, cam in enumerate(("front", "wrist")):
        expected = np.concatenate([e.images[cam] for e in episodes])
        np.testing.assert_array_equal(images_N_V_H_W_3[:, v], expected)
    assert inspect(tmp_path / "ds").success_rate is None


def test_write_dataset_rejects_bad_episodes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    bad = _synthetic([4, 4])
    bad[1].action_T_A[2, 0] = np.nan
    with pytest.raises(DatasetError, match=r"episode 1: non-finite action at frame 2"):
        write_dataset(tmp_path / "ds", bad, fps=10)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DatasetError, match="no episodes"):
        write_dataset(tmp_path / "ds", [], fps=10)
    uneven = _synthetic([4])
    uneven[0].images["wrist"] = uneven[0].images["wrist"][:, :4]
    with pytest.raises(DatasetError, match=r"camera 'wrist' .* the size of 'front'"):
        write_dataset(tmp_path / "ds", uneven, fps=10)
    assert list(tmp_path.iterdir()) == []


def _all_batches(ds, **kwargs) -> list:
    return list(iter_batches(ds, **kwargs))


def test_batches_are_deterministic_and_cover_every_frame_once_per_epoch(recorded: Path) -> None:
    ds = load_dataset(recorded)
    args = {"batch_size": 8, "chunk_len": 4, "seed": 1}
    epoch0 = _all_batches(ds, epoch=0, **args)
    again = _all_batches(ds, epoch=0, **args)
    epoch1 = _all_batches(ds, epoch=1, **args)
    assert len(epoch0) == ds.num_batches(8) == -(-len(ds) // 8)
    for a, b in zip(epoch0, again, strict=True):
        np.testing.assert_array_equal(a.index_B, b.index_B)
        np.testing.assert_array_equal(a.images_B_V_H_W_3, b.images_B_V_H_W_3)
        np.testing.assert_array_equal(a.actions_B_C_A, b.actions_B_C_A)
    for batches in (epoch0, epoch1):
        assert [(b.epoch, b.batch_index) for b in batches] == [
            (batches[0].epoch, i) for i in range(len(batches))
        ]
        seen = np.concatenate([b.index_B for b in batches])
        np.testing.assert_array_equal(np.sort(seen), np.arange(len(ds)))
    assert not np.array_equal(
        np.concatenate([b.index_B for b in epoch0]), np.concatenate([b.index_B for b in epoch1])
    )
    # Resuming mid-epoch yields the rest of the same epoch; drop_last drops the ragged tail.
    resumed = _all_batches(ds, epoch=0, start_batch=2, **args)
    assert [b.index_B.tolist() for b in resumed] == [b.index_B.tolist() for b in epoch0[2:]]
    full = _all_batches(ds, epoch=0, drop_last=True, **args)
    assert len(full) == ds.num_batches(8, drop_last=True) == len(ds) // 8
    assert all(len(b.index_B) == 8 for b in full)


def test_batch_contents_match_the_frames(recorded: Path) -> None:
    ds = load_dataset(recorded)
    uncached = load_dataset(recorded, image_cache_mb=0)  # decodes per batch instead
    for batch, lazy in zip(
        iter_batches(ds, 5, 1, seed=0, epoch=3),
        iter_batches(uncached, 5, 1, seed=0, epoch=3),
        strict=True,
    ):
        rows = batch.index_B
        assert batch.images_B_V_H_W_3.shape == (len(rows), 1, SIZE, SIZE, 3)
        assert batch.images_B_V_H_W_3.dtype == np.uint8
        assert batch.state_B_S.dtype == np.float32 and batch.actions_B_C_A.dtype == np.float32
        np.testing.assert_array_equal(batch.images_B_V_H_W_3, lazy.images_B_V_H_W_3)
        np.testing.assert_array_equal(batch.state_B_S, ds.state_N_S[rows])
        np.testing.assert_array_equal(batch.actions_B_C_A[:, 0], ds.action_N_A[rows])
        np.testing.assert_array_equal(batch.episode_index_B, ds.episode_index_N[rows])
        assert batch.instructions == [ds.tasks[t] for t in ds.task_index_N[rows]]


def test_action_chunks_pad_with_the_last_action_at_episode_ends(recorded: Path) -> None:
    ds = load_dataset(recorded)
    chunk = 6
    for batch in iter_batches(ds, 16, chunk, seed=2, epoch=0):
        for b, row in enumerate(batch.index_B.tolist()):
            ep = ds.episodes[int(ds.episode_index_N[row])]
            for c in range(chunk):
                source = min(row + c, ep.to_index - 1)
                np.testing.assert_array_equal(batch.actions_B_C_A[b, c], ds.action_N_A[source])
                assert batch.action_pad_B_C[b, c] == (row + c >= ep.to_index)
    last = np.array([ep.to_index - 1 for ep in ds.episodes])
    (padded,) = iter_batches(ds, len(ds), chunk, seed=0, epoch=0)
    at_end = np.isin(padded.index_B, last)
    assert padded.action_pad_B_C[at_end, 1:].all() and not padded.action_pad_B_C[:, 0].any()


def test_split_by_episode_and_sample_one_split(recorded: Path) -> None:
    ds = load_dataset(recorded)
    train, val = ds.split(0.34, seed=0)
    assert (train, val) == ds.split(0.34, seed=0)
    assert len(val) == 2 and sorted(train + val) == list(range(EPISODES))
    assert ds.split(0.0, seed=0) == (list(range(EPISODES)), [])
    assert len(ds.split(0.01, seed=0)[1]) == 1  # a requested val split is never empty
    rows = np.concatenate(
        [np.arange(ds.episodes[e].from_index, ds.episodes[e].to_index) for e in val]
    )
    seen = np.concatenate([b.index_B for b in iter_batches(ds, 4, 2, 0, 0, episodes=val)])
    np.testing.assert_array_equal(np.sort(seen), rows)
    assert ds.num_batches(4, episodes=val) == -(-len(rows) // 4)
    with pytest.raises(ValueError, match="episode 99"):
        ds.num_batches(4, episodes=[99])


def test_streaming_batches_is_fast(recorded: Path) -> None:
    ds = load_dataset(recorded, image_cache_mb=0)  # the slow path: decode every batch
    start, frames = time.perf_counter(), 0
    for epoch in range(3):
        for batch in iter_batches(ds, 32, 8, seed=0, epoch=epoch):
            frames += len(batch.index_B)
    rate = frames / (time.perf_counter() - start)
    assert rate > 1000, f"{rate:.0f} frames/s"


# -- validation -------------------------------------------------------------------------


def _edit(root: Path, rel: str, fn: Callable[[pa.Table], pa.Table]) -> None:
    pq.write_table(fn(pq.read_table(root / rel)), root / rel)


def _replace(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, array)


def _row(table: pa.Table, episode: int, frame: int) -> int:
    ep = table.column("episode_index").to_numpy()
    fr = table.column("frame_index").to_numpy()
    return int(np.flatnonzero((ep == episode) & (fr == frame))[0])


def _with_vector(name: str, episode: int, frame: int, value: float) -> Callable:
    def fn(table: pa.Table) -> pa.Table:
        column = table.column(name).combine_chunks()
        values = column.flatten().to_numpy().reshape(len(column), -1).copy()
        values[_row(table, episode, frame), 0] = value
        array = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
        return _replace(table, name, array)

    return fn


def _reshaped(name: str, size: int) -> Callable:
    def fn(table: pa.Table) -> pa.Table:
        values = table.column(name).combine_chunks().flatten().to_numpy()
        values = values.reshape(len(table), -1)[:, :1].repeat(size, axis=1).reshape(-1)
        return _replace(table, name, pa.FixedSizeListArray.from_arrays(pa.array(values), size))

    return fn


def _set_int(name: str, episode: int, frame: int, value: int) -> Callable:
    def fn(table: pa.Table) -> pa.Table:
        values = table.column(name).to_numpy().copy()
        values[_row(table, episode, frame)] = value
        return _replace(table, name, pa.array(values))

    return fn


def _set_image(episode: int, frame: int, data: Callable[[bytes], bytes]) -> Callable:
    def fn(table: pa.Table) -> pa.Table:
        images = table.column(IMAGE_KEY).to_pylist()
        row = _row(table, episode, frame)
        images[row] = data(images[row])
        return _replace(table, IMAGE_KEY, pa.array(images, pa.binary()))

    return fn


def _edit_info(**changes: object) -> Callable[[Path], None]:
    def fn(root: Path) -> None:
        info = json.loads((root / "meta/info.json").read_text())
        info.update(changes)
        (root / "meta/info.json").write_text(json.dumps(info))

    return fn


def _in(rel: str, fn: Callable[[pa.Table], pa.Table]) -> Callable[[Path], None]:
    return lambda root: _edit(root, rel, fn)


def _camera_shape(shape: list[int]) -> Callable[[Path], None]:
    def fn(root: Path) -> None:
        info = json.loads((root / "meta/info.json").read_text())
        info["features"][IMAGE_KEY]["shape"] = shape
        (root / "meta/info.json").write_text(json.dumps(info))

    return fn


def _second_camera_of_another_size(root: Path) -> None:
    info = json.loads((root / "meta/info.json").read_text())
    wrist = "observation.images.wrist"
    info["features"][wrist] = {**info["features"][IMAGE_KEY], "shape": [SIZE // 2, SIZE // 2, 3]}
    info["camera_keys"] = [IMAGE_KEY, wrist]
    (root / "meta/info.json").write_text(json.dumps(info))


def _no_frames(root: Path) -> None:
    """Every table emptied and the totals set to match: a well-formed dataset of nothing."""
    for rel in ("meta/episodes.parquet", DATA):
        _edit(root, rel, lambda t: t.slice(0, 0))
    _edit_info(total_episodes=0, total_frames=0)(root)
    (root / "meta/stats.json").unlink()


def _bomb_png(png: bytes) -> bytes:
    """A PNG whose header says SIZE x SIZE but whose pixel data inflates to 100 frames."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", SIZE, SIZE, 8, 2, 0, 0, 0)
    pixels = zlib.compress(bytes(100 * SIZE * (1 + 3 * SIZE)))
    return png[:8] + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def _png_of(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "missing info.json": (lambda root: (root / "meta/info.json").unlink(), ["meta/info.json"]),
    "missing tasks": (lambda root: (root / "meta/tasks.parquet").unlink(), ["tasks.parquet"]),
    "info field of the wrong type": (_edit_info(fps="ten"), ["meta/info.json", "fps"]),
    "info totals": (_edit_info(total_frames=1), ["total_frames=1"]),
    "missing action column": (_in(DATA, lambda t: t.drop_columns(["action"])), ["'action'"]),
    "missing image column": (_in(DATA, lambda t: t.drop_columns([IMAGE_KEY])), [IMAGE_KEY]),
    "state of the wrong shape": (
        _in(DATA, _reshaped("observation.state", 3)),
        ["'observation.state'", "(4,)", "(3,)"],
    ),
    "action of the wrong shape": (
        _in(DATA, _reshaped("action", 7)),
        ["'action'", "(2,)", "(7,)"],
    ),
    "nan action": (
        _in(DATA, _with_vector("action", 2, 1, np.nan)),
        ["'action'", "episode 2, frame 1"],
    ),
    "inf state": (
        _in(DATA, _with_vector("observation.state", 4, 0, np.inf)),
        ["'observation.state'", "episode 4, frame 0"],
    ),
    "unknown task_index": (
        _in(DATA, _set_int("task_index", 1, 2, 99)),
        ["task_index 99", "episode 1, frame 2"],
    ),
    "episode_index out of place": (
        _in(DATA, _set_int("episode_index", 1, 1, 2)),
        ["'episode_index'", "episode 1 follows episode 2"],
    ),
    "frame_index out of order": (
        _in(DATA, _set_int("frame_index", 3, 2, 0)),
        ["'frame_index'", "episode 3"],
    ),
    "index not sequential": (_in(DATA, _set_int("index", 0, 1, 5)), ["'index'", "row 1"]),
    "episode length disagrees with episodes.parquet": (
        _in(
            "meta/episodes.parquet",
            lambda t: _replace(t, "length", pa.array([100, *t.column("length").to_pylist()[1:]])),
        ),
        ["episode 0", "length 100"],
    ),
    "episode missing from episodes.parquet": (
        _in("meta/episodes.parquet", lambda t: t.slice(0, EPISODES - 1)),
        [f"episode {EPISODES - 1}", "episodes.parquet"],
    ),
    "garbage image": (
        _in(DATA, _set_image(1, 2, lambda png: b"not a png")),
        [IMAGE_KEY, "unreadable image", "episode 1, frame 2"],
    ),
    "truncated image": (
        _in(DATA, _set_image(3, 0, lambda png: png[: len(png) // 2])),
        [IMAGE_KEY, "unreadable image", "episode 3, frame 0"],
    ),
    "image with oversized pixel data": (
        _in(DATA, _set_image(2, 0, _bomb_png)),
        [IMAGE_KEY, "unreadable image", "episode 2, frame 0", "oversized"],
    ),
    "image of the wrong size": (
        _in(DATA, _set_image(0, 1, lambda png: _png_of(np.zeros((8, 8, 3), np.uint8)))),
        [IMAGE_KEY, "episode 0, frame 1", "(8, 8, 3)"],
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_dataset_raises_an_error_naming_the_problem(
    recorded: Path, tmp_path: Path, corruption: str
) -> None:
    root = tmp_path / "corrupt"
    shutil.copytree(recorded, root)
    corrupt, needles = CORRUPTIONS[corruption]
    corrupt(root)
    with pytest.raises(DatasetError) as error:
        load_dataset(root)
    for needle in needles:
        assert needle in str(error.value), f"{needle!r} not in {error.value}"


def test_foreign_pngs_with_row_filters_are_decoded_by_pillow(
    recorded: Path, tmp_path: Path
) -> None:
    root = tmp_path / "pillow"
    shutil.copytree(recorded, root)
    ds = load_dataset(recorded)
    # Re-encode every frame with Pillow (adaptive row filters), as another tool would.
    frames = ds.images(np.arange(len(ds)))[:, 0]
    _edit(root, DATA, lambda t: _replace(t, IMAGE_KEY, pa.array([_png_of(f) for f in frames])))
    np.testing.assert_array_equal(load_dataset(root).images(np.arange(len(ds)))[:, 0], frames)


# -- the submit-time check (the master's) ----------------------------------------------------


def test_submit_check_plans_the_same_batches_as_the_loaded_dataset(recorded: Path) -> None:
    meta, ds = check_dataset(recorded), load_dataset(recorded)
    assert meta.episodes == ds.episodes and meta.tasks == ds.tasks
    assert (meta.action_dim, meta.state_dim, meta.num_frames) == (2, 4, len(ds))
    assert meta.camera_keys == ds.camera_keys == (IMAGE_KEY,)
    for fraction, seed in ((0.0, 0), (0.34, 1), (0.5, 2)):
        train, val = meta.split(fraction, seed)
        assert (train, val) == ds.split(fraction, seed)
        for size in (1, 4, 7):
            assert meta.num_batches(size, train, drop_last=True) == ds.num_batches(
                size, train, drop_last=True
            )


def test_submit_check_decodes_a_sample_and_the_full_validation_names_a_later_bad_frame(
    recorded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "late"
    shutil.copytree(recorded, root)
    _edit(root, DATA, _set_image(EPISODES - 2, 2, lambda png: b"not a png"))
    import vla.data.meta

    decoded: list[str] = []
    decode = vla.data.meta.decode_png

    def counting(data: bytes, shape: tuple[int, ...], key: str, where: str) -> np.ndarray:
        decoded.append(where)
        return decode(data, shape, key, where)

    monkeypatch.setattr(vla.data.meta, "decode_png", counting)
    meta = check_dataset(root)  # accepted: the bad frame is not in the sample
    assert meta.num_episodes == EPISODES
    last = meta.episodes[-1]
    assert decoded[0] == "episode 0, frame 0"
    assert decoded[-1] == f"episode {last.episode_index}, frame {last.length - 1}"
    assert len(decoded) == 4 < meta.num_frames
    with pytest.raises(DatasetError, match=rf"unreadable image at episode {EPISODES - 2}, frame 2"):
        load_dataset(root)


def _one_frame_less_in_the_metadata(root: Path) -> None:
    """episodes.parquet and info.json agree on one frame fewer than the data holds."""
    lengths = pq.read_table(root / "meta/episodes.parquet").column("length").to_pylist()
    shorter = pa.array([lengths[0] - 1, *lengths[1:]])
    _edit(root, "meta/episodes.parquet", lambda t: _replace(t, "length", shorter))
    _edit_info(total_frames=sum(lengths) - 1)(root)


def _garbage_last_frame(root: Path) -> None:
    last = pq.read_table(root / "meta/episodes.parquet").column("length").to_pylist()[-1]
    _edit(root, DATA, _set_image(EPISODES - 1, last - 1, lambda png: b"not a png"))


#: What the submit check finds without reading the frames: metadata, schemas, sampled frames.
CHECKED: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    **{
        name: CORRUPTIONS[name]
        for name in (
            "missing info.json",
            "missing tasks",
            "info field of the wrong type",
            "missing action column",
            "missing image column",
            "state of the wrong shape",
            "action of the wrong shape",
        )
    },
    "info totals": (_edit_info(total_frames=1), ["total_frames=1", "episodes.parquet"]),
    "episode missing from episodes.parquet": (
        CORRUPTIONS["episode missing from episodes.parquet"][0],
        [f"total_episodes={EPISODES}", "episodes.parquet"],
    ),
    "info totals agree with episodes.parquet but not with the data": (
        _one_frame_less_in_the_metadata,
        ["total_frames=", "the data files have"],
    ),
    "garbage image in the last frame": (
        _garbage_last_frame,
        [IMAGE_KEY, "unreadable image", f"episode {EPISODES - 1}, frame "],
    ),
    "image of the wrong size in the first frame": (
        _in(DATA, _set_image(0, 0, lambda png: _png_of(np.zeros((8, 8, 3), np.uint8)))),
        [IMAGE_KEY, "episode 0, frame 0", "(8, 8, 3)"],
    ),
    # Found by an audit: these passed the push and submit checks and failed the job later.
    "a camera that is not (height, width, 3)": (
        _camera_shape([SIZE]),
        [IMAGE_KEY, "must have shape (height, width, 3)", f"({SIZE},)"],
    ),
    "cameras of different sizes": (
        _second_camera_of_another_size,
        ["cameras have different image shapes", "observation.images.wrist"],
    ),
    "no frames at all": (_no_frames, ["the data files have no frames"]),
}


def _one_row_group_of(root: Path, frames: int) -> None:
    """The dataset ``root`` (one episode) made ``frames`` long: its first frame repeated in
    one row group, every image the same dictionary-encoded PNG (a few bytes a frame)."""
    table = pq.read_table(root / DATA)
    rows = pa.array(np.zeros(frames, np.int64))
    pq.write_table(table.take(rows), root / DATA, row_group_size=frames, compression="zstd")
    episodes = pq.read_table(root / "meta/episodes.parquet")
    episodes = _replace(episodes, "length", pa.array([frames]))
    episodes = _replace(episodes, "dataset_to_index", pa.array([frames]))
    pq.write_table(episodes, root / "meta/episodes.parquet")
    _edit_info(total_frames=frames)(root)


def test_the_submit_check_reads_a_huge_row_group_in_bounded_memory(tmp_path: Path) -> None:
    """Found by an audit: a pushed dataset of a few hundred KB whose one row group holds
    millions of frames of one dictionary-encoded image took the master gigabytes to check
    (the whole row group was read to decode four sampled frames)."""
    root = tmp_path / "bomb"
    record(REACH2D_ID, 1, root, seed=0, env_kwargs={"image_size": 8})
    frames = 1_000_000
    _one_row_group_of(root, frames)
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) < 1_000_000
    # The child's peak memory is reset (clear_refs 5) once its imports are done: the peak
    # after the check, less the memory in use before it, is what the check took.
    script = (
        "import sys; from vla.data import check_dataset; "
        "kib = lambda key: int(next(line.split()[1] for line in open('/proc/self/status') "
        "if line.startswith(key))); "
        "open('/proc/self/clear_refs', 'w').write('5'); before = kib('VmRSS:'); "
        "meta = check_dataset(sys.argv[1]); "
        "print(meta.num_frames, (kib('VmHWM:') - before) // 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    checked, grew_mib = map(int, out.stdout.split())
    assert checked == frames
    assert grew_mib < 100, f"checking it took {grew_mib} MiB more"


@pytest.mark.parametrize("corruption", list(CHECKED))
def test_submit_check_raises_an_error_naming_the_problem(
    recorded: Path, tmp_path: Path, corruption: str
) -> None:
    root = tmp_path / "corrupt"
    shutil.copytree(recorded, root)
    corrupt, needles = CHECKED[corruption]
    corrupt(root)
    with pytest.raises(DatasetError) as error:
        check_dataset(root)
    for needle in needles:
        assert needle in str(error.value), f"{needle!r} not in {error.value}"
