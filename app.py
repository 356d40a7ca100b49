"""MiniMax Music 3 in the browser: `python app.py [--model M] [--engine E] [--host H] [--port P] [--share] ...`.

Also the Hugging Face Space's app_file. Flags → backend (in-process: the model holder, which loads in the background
so the page opens at once; or `--backend ray`: SongWorker replicas on a Ray cluster) → song store with its TTL cleaner
→ Gradio page with a bounded queue → launch.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import sys
from dataclasses import dataclass

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # a local demo should not phone home
if importlib.util.find_spec("spaces") is not None:
    # Hugging Face ZeroGPU patches torch when `spaces` is imported and refuses to work once anything has initialised
    # CUDA, so it comes first (outside ZeroGPU importing it changes nothing).
    import spaces  # noqa: F401


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from music3_demo.checkpoint import default_model
    from music3_demo.memory_plan import SWAP_MODES
    from music3_demo.precision import DIT_PRECISIONS, KV_PRECISIONS, PRECISIONS
    from music3_demo.semantic import ENGINE_NAMES
    from music3_demo.serve.backend import BACKENDS

    parser = argparse.ArgumentParser(description="MiniMax Music 3 song generator (Gradio app).")
    parser.add_argument("--model", default=default_model(),
                        help="Hub repo id, local checkpoint folder, 'tiny' or 'random-full' (default: $MUSIC3_MODEL "
                             "or MiniMaxAI/MiniMax-Music3)")
    parser.add_argument("--engine", default="auto", choices=ENGINE_NAMES,
                        help="semantic-stage engine: graph on CUDA, reference elsewhere (default: auto)")
    parser.add_argument("--precision", default="auto", choices=PRECISIONS,
                        help="LM / depth-decoder weights: bf16 (exact), fp8 (sm_89+), int8; auto = what each GPU's "
                             "memory plan picks: bf16 where a 6-minute song fits, else fp8 or int8 (default: auto)")
    parser.add_argument("--dit-precision", default="auto", choices=DIT_PRECISIONS,
                        help="flow transformer (DiT) weights: bf16, fp8 (sm_89+); auto = fp8 only where the bf16 DiT "
                             "does not fit the GPU (default: auto)")
    parser.add_argument("--kv-precision", default="auto", choices=KV_PRECISIONS,
                        help="the graph engine's KV cache: bf16 (exact), int8 (half the memory per second of song); "
                             "auto = int8 only where a bf16 cache leaves the songs short (default: auto)")
    parser.add_argument("--swap", default="auto", choices=SWAP_MODES,
                        help="the two stages take turns on the GPU, their weights moved whole through pinned host "
                             "memory, a song at a time, its frames handed over in turns so it still streams; auto = "
                             "only where the model does not fit with both stages on the GPU (default: auto)")
    parser.add_argument("--devices", default=None,
                        help="comma-separated devices, each running as many songs at once as its engine has batch "
                             "slots (default: every CUDA GPU, else the CPU); cuda:0+cuda:1 is one device whose "
                             "frames are made on cuda:0 and audio on cuda:1 (a stage split)")
    parser.add_argument("--host", default=None, help="address to listen on (default: Gradio's, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: Gradio's, 7860 or the next free)")
    parser.add_argument("--share", action="store_true", help="also open a temporary public gradio.live link")
    parser.add_argument("--max-queue", type=int, default=32,
                        help="songs that may wait for a device; more are refused (32)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="songs running at once over all devices, at most (default: every device's slots)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--preload", dest="preload", action="store_true", default=True,
                      help="load the model at start-up, in the background (default)")
    load.add_argument("--lazy-load", dest="preload", action="store_false", help="load the model on the first song")
    parser.add_argument("--output-dir", default=None,
                        help="where finished songs are written (default: $MUSIC3_OUTPUTS or <tmp>/music3_demo_outputs)")
    parser.add_argument("--ttl-hours", type=float, default=24.0, help="delete finished songs after this long (24)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the one-second warm-up song after each load (the first song pays its costs)")
    cluster = parser.add_argument_group("cluster (--backend ray; docs/DEPLOY.md)")
    cluster.add_argument("--backend", default="local", choices=BACKENDS,
                         help="local: songs made in this process (default); ray: on SongWorker replicas of a Ray "
                              "cluster, this process being the page and the line")
    cluster.add_argument("--ray-address", default=None,
                         help="join this running Ray cluster (e.g. 10.0.0.1:6379); default: start one here")
    cluster.add_argument("--replicas", type=int, default=None,
                         help="SongWorker replicas (default: the cluster's GPUs, or 1 without GPUs)")
    cluster.add_argument("--replica-device", default=None,
                         help="what a replica runs on: cuda:0 (one GPU each, the default on a cluster with GPUs), "
                              "cuda:0+cuda:1 (a stage split over two), or cpu")
    cluster.add_argument("--replica-slots", type=int, default=None,
                         help="songs a replica takes at once (default: the engines' batch slots)")
    args = parser.parse_args(argv)
    if args.max_queue < 1 or (args.concurrency is not None and args.concurrency < 1):
        parser.error("--max-queue and --concurrency must be at least 1.")
    if args.ttl_hours <= 0:
        parser.error("--ttl-hours must be positive.")
    ray_only = [flag for flag, value in (("--ray-address", args.ray_address), ("--replicas", args.replicas),
                                         ("--replica-device", args.replica_device),
                                         ("--replica-slots", args.replica_slots)) if value is not None]
    if args.backend != "ray" and ray_only:
        parser.error(f"{', '.join(ray_only)} need --backend ray.")
    if args.backend == "ray" and args.devices:
        parser.error("--devices is for the local backend; a Ray cluster's replicas take --replica-device.")
    if any(value is not None and value < 1 for value in (args.replicas, args.replica_slots)):
        parser.error("--replicas and --replica-slots must be at least 1.")
    return args


def make_backend(args: argparse.Namespace, space: bool):
    """The backend the flags name; ValueError / RuntimeError with one sentence when they cannot work here."""
    if args.backend == "ray":
        from music3_demo.serve.ray_backend import RayBackend  # the one place Ray enters the process

        return RayBackend.from_flags(args)
    from music3_demo.devices import split_devices
    from music3_demo.memory import free_and_capability
    from music3_demo.precision import refuse_unsupported
    from music3_demo.semantic import resolve_engine_name
    from music3_demo.serve.holder import default_devices
    from music3_demo.serve.local import LocalBackend

    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else default_devices()
    stages = [split_devices(device) for device in devices]  # "cuda:0+cuda:1": the engine on cuda:0
    named = [str(part) for parts in stages for part in parts if part is not None]
    if len(named) != len(set(named)):
        raise ValueError(f"--devices names a GPU twice ({', '.join(devices)}): each device runs its own model.")
    for semantic, flow in stages:
        resolve_engine_name(args.engine, semantic)
        # an fp8 asked for on a GPU without it is refused before a long load (on a CPU the plan says what runs)
        for card, asked in ((semantic, (args.precision, "auto")), (flow or semantic, ("auto", args.dit_precision))):
            if (capability := free_and_capability(card)[1]) is not None:
                refuse_unsupported(*asked, capability)
    # ZeroGPU runs CUDA work only inside spaces.GPU calls, in worker processes (serve/zerogpu.py): the weights are
    # placed at start-up, the engines are built by each worker's first song, and there is no warm-up song here.
    return LocalBackend(args.model, devices, args.engine, warmup=args.warmup and not space, precision=args.precision,
                        lazy=space, max_running=args.concurrency, dit_precision=args.dit_precision,
                        kv_precision=args.kv_precision, swap=args.swap)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per internal HTTP request is noise
    from music3_demo.versions import untested_warnings

    for line in untested_warnings():
        logging.warning(line)

    try:
        served = build(args)
    except (ValueError, RuntimeError) as error:
        sys.exit(f"app.py: {error}")
    if args.backend == "ray":  # a stopped front takes its replicas with it (release), not only on Ctrl-C
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        served.demo.launch(**served.launch)
    finally:
        served.close()


@dataclass
class Served:
    """What build() makes: the backend, the song store and the page, with the page's launch() options."""

    backend: object
    store: object
    demo: object
    launch: dict

    def close(self) -> None:
        self.store.stop_cleaner()
        self.store.close(timeout=60)  # the files of songs already handed over are written before the process ends
        self.backend.release()


def build(args: argparse.Namespace) -> Served:
    """Flags → backend → song store → page, ready to launch; ValueError / RuntimeError with one sentence when the
    flags cannot work here."""
    from music3_demo.ui import AppContext, build_ui, launch_options
    from music3_demo.ui.admission import GRADIO_QUEUE_HEADROOM
    from music3_demo.serve.zerogpu import zero_gpu
    from music3_demo.serve.runner import JobRegistry, register_holder
    from music3_demo.serve.store import SongStore

    space = zero_gpu()
    backend = make_backend(args, space)
    if space:
        register_holder(backend)  # before ZeroGPU forks its first worker, which must find it (serve/runner.py)
    if args.preload or space:
        # ZeroGPU wants the weights placed at start-up in the main process; elsewhere load behind the open page.
        backend.preload(background=not space)
    store = SongStore(args.output_dir, ttl_s=args.ttl_hours * 3600)
    store.start_cleaner()
    # The store's folder is this app's own Gradio cache: Gradio then serves the songs where they are (a file
    # already in its cache is not copied), so the cleaner's TTL is the files' whole life, and nothing of ours
    # lands in the temp folder every Gradio app on the host shares. Set before any Blocks reads it.
    os.environ["GRADIO_TEMP_DIR"] = str(store.root.resolve())
    # Songs wait in the backend's line (first come, first served, place and estimated start shown; the songs that
    # fit run together), not in Gradio's queue, which would hide both: Gradio runs every admitted song's handler at
    # once. On ZeroGPU a handler holds a GPU for its whole call, so Gradio's queue keeps one song per device there.
    places = len(backend.status().devices)  # devices, or a cluster's replicas
    concurrency = (args.concurrency or places) if space else None
    ctx = AppContext(backend, store, JobRegistry(), live_audio=shutil.which("ffmpeg") is not None,
                     max_queue=args.max_queue)
    if not ctx.live_audio:
        logging.warning("ffmpeg not found: live playback is off; songs appear when finished (install ffmpeg).")
    demo = build_ui(ctx, concurrency)
    # Songs are bounded by --max-queue on arrival (ui/admission.py); Gradio's bound only guards against floods.
    demo.queue(max_size=args.max_queue + GRADIO_QUEUE_HEADROOM,
               default_concurrency_limit=args.concurrency or places)
    # max_file_size=0: the app takes no uploads, so none may fill the disk.
    # Every admitted song's handler runs at once, each holding a worker thread for up to a tick at a time while it
    # waits or streams; the status calls share that pool, so it has room for all of them (Gradio's 40 + the songs
    # that may wait + a generous bound on those running).
    launch = dict(server_name=args.host, server_port=args.port, share=args.share, allowed_paths=[str(store.root)],
                  show_error=True, max_file_size=0, max_threads=40 + args.max_queue + 16 * places, **launch_options())
    return Served(backend, store, demo, launch)


if __name__ == "__main__":
    main()
