"""The engine addon: pinned, verified, unpacked safely, or a clear error."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from codemode.runtime import isolated_vm
from codemode.runtime.engine import find_node
from codemode.runtime.isolated_vm import EngineSetupError, _extract, ensure_isolated_vm


def tarball(tmp_path: Path, members: dict[str, bytes]) -> Path:
    path = tmp_path / "package.tgz"
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_only_the_kept_files_of_the_package_are_unpacked(tmp_path: Path) -> None:
    source = tarball(
        tmp_path,
        {
            "package/package.json": b"{}",
            "package/prebuilds/linux-x64/addon.node": b"elf",
            "package/src/evil.cc": b"no",
            "package/../escape.txt": b"no",
            "/abs.txt": b"no",
            "other/package.json": b"no",
        },
    )
    out = tmp_path / "out"
    _extract(source, out)
    found = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert found == ["package.json", "prebuilds/linux-x64/addon.node"]
    assert not (tmp_path / "escape.txt").exists()


def test_a_configured_directory_must_hold_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODEMODE_ISOLATED_VM", str(tmp_path))
    with pytest.raises(EngineSetupError, match="is not an unpacked isolated-vm package"):
        ensure_isolated_vm(find_node())


@pytest.mark.slow
def test_a_tarball_that_fails_its_integrity_check_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CODEMODE_ISOLATED_VM", raising=False)
    monkeypatch.setenv("CODEMODE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(isolated_vm, "INTEGRITY", "sha512-AAAA")
    with pytest.raises(EngineSetupError, match="failed its integrity check"):
        ensure_isolated_vm(find_node())
    assert not (tmp_path / f"isolated-vm-{isolated_vm.VERSION}").exists()
