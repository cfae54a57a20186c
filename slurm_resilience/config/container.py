"""The ``container:`` section: the image every worker, standby and relaunch step runs in.

Its own module, like ``config.job``: the container is a component of its own
(``slurm_resilience/container/``), and the runtime names are its vocabulary.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from slurm_resilience.errors import ConfigError


__all__ = ["Runtime", "ContainerConfig", "parse_mount"]


class Runtime(enum.Enum):
    """How a step enters its container.

    NONE: no container, the step's command runs on the node itself.
    PYXIS: Slurm's pyxis/enroot plugin, through srun's own ``--container-*`` flags.
    APPTAINER: ``apptainer exec IMAGE command`` wraps the step's command.
    PODMAN: ``podman run ... IMAGE command`` wraps the step's command.
    """

    NONE = "none"
    PYXIS = "pyxis"
    APPTAINER = "apptainer"
    PODMAN = "podman"


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MOUNT_OPTS = {"ro", "rw"}


@dataclass(frozen=True, kw_only=True)
class ContainerConfig:
    """The container of every worker, standby and relaunch step (docs/containers.md).

    Fields:
        runtime: ``none`` (default), ``pyxis``, ``apptainer`` or ``podman``.
        image: the image: an enroot/pyxis image reference or squashfs path (pyxis), a
            SIF file or ``docker://`` URI (apptainer), an image name (podman).
            Required unless ``runtime`` is none.
        mounts: ``SRC[:DST[:ro|rw]]`` bind mounts, absolute paths. The job directory
            and ``workdir`` are always mounted at their own paths.
        workdir: the directory the command starts in, inside the container; empty: the
            directory the supervisor was started from.
        env: names of variables passed from the step's environment into the container
            (the toolkit's own ``SR_*`` and Slurm's ``SLURM_*`` always are).
        gpus: pass the node's GPUs through (apptainer ``--nv``, podman
            ``--device nvidia.com/gpu=all``; pyxis/enroot does it on its own).
        extra_args: more options for the runtime, verbatim as argv: ``podman run`` or
            ``apptainer exec`` options before the image, or srun options for pyxis.
    """

    runtime: str = "none"
    image: str = ""
    mounts: tuple[str, ...] = ()
    workdir: str = ""
    env: tuple[str, ...] = ()
    gpus: bool = False
    extra_args: tuple[str, ...] = ()

    @property
    def kind(self) -> Runtime:
        return Runtime(self.runtime)

    def __post_init__(self) -> None:
        valid = [r.value for r in Runtime]
        if self.runtime not in valid:
            raise ConfigError(f"container.runtime={self.runtime!r} is not a runtime: use one of {', '.join(valid)}")
        if self.kind is Runtime.NONE:
            return
        if not self.image.strip():
            raise ConfigError(f"container.image is empty: runtime {self.runtime} needs the image to run "
                              "(e.g. image: /shared/images/train.sif or localhost/train:latest)")
        if any(c.isspace() or c == "," for c in self.image):
            raise ConfigError(f"container.image={self.image!r} holds a space or a comma: give one image reference")
        for mount in self.mounts:
            parse_mount(mount)
        if self.workdir and not self.workdir.startswith("/"):
            raise ConfigError(f"container.workdir={self.workdir!r} must be an absolute path (or empty)")
        for name in self.env:
            if not _ENV_NAME.fullmatch(name):
                raise ConfigError(f"container.env entry {name!r} is not a variable name: list names only "
                                  "(their values come from the step's environment)")


def parse_mount(mount: str) -> tuple[str, str, str]:
    """``SRC[:DST[:ro|rw]]`` → (src, dst, mode); mode is "rw" unless given.

    Raises:
        ConfigError: a relative path, a comma (pyxis joins mounts with commas), or an
            unknown mode.
    """
    parts = mount.split(":")
    if len(parts) > 3 or not parts[0]:
        raise ConfigError(f"container.mounts entry {mount!r} must look like SRC, SRC:DST or SRC:DST:ro")
    src = parts[0]
    dst = parts[1] if len(parts) > 1 and parts[1] else src
    mode = parts[2] if len(parts) > 2 else "rw"
    if not (src.startswith("/") and dst.startswith("/")):
        raise ConfigError(f"container.mounts entry {mount!r}: both paths must be absolute")
    if "," in mount or any(c.isspace() for c in mount):
        raise ConfigError(f"container.mounts entry {mount!r} holds a comma or a space: one mount per entry")
    if mode not in _MOUNT_OPTS:
        raise ConfigError(f"container.mounts entry {mount!r}: mode must be ro or rw, got {mode!r}")
    return src, dst, mode
