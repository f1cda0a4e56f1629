"""The one module that knows image file formats: NIfTI via nibabel, `.npy`/`.npz` natively.

Arrays are returned as numpy (Z, Y, X) with spacing (z, y, x) in millimetres — the axis
order nnU-Net uses after its SimpleITK reader. NIfTI stores (x, y, z), so we transpose.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SUPPORTED_ENDINGS = (".nii.gz", ".nii", ".npy", ".npz")


class ImageReadError(ValueError):
    """A file that cannot be read as an image (the message names the file)."""


def file_ending(path: Path) -> str:
    name = path.name
    for ending in SUPPORTED_ENDINGS:
        if name.endswith(ending):
            return ending
    return path.suffix


def read_image(
    path: Path, fallback_spacing_zyx: tuple[float, ...] | None = None
) -> tuple[np.ndarray, tuple[float, float, float]]:
    """One 3D volume and its spacing (z, y, x) in mm.

    `.npy`/`.npz` carry no geometry: their spacing comes from dataset.json ("spacing",
    given in z, y, x), else 1 mm isotropic.
    """
    ending = file_ending(path)
    try:
        if ending in (".nii.gz", ".nii"):
            import nibabel as nib

            image = nib.load(str(path))
            data = np.asarray(image.dataobj)
            zooms = tuple(float(z) for z in image.header.get_zooms()[:3])
            if data.ndim != 3:
                raise ImageReadError(f"{path}: expected a 3D image, got shape {data.shape}")
            return np.ascontiguousarray(data.transpose(2, 1, 0)), (zooms[2], zooms[1], zooms[0])
        if ending == ".npy":
            data = np.load(path, allow_pickle=False)
        elif ending == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                keys = list(archive.keys())
                data = archive["data"] if "data" in keys else archive[keys[0]]
        else:
            raise ImageReadError(f"{path}: unsupported file type {ending!r}")
    except ImageReadError:
        raise
    except Exception as exc:  # nibabel/numpy raise many types for broken files
        raise ImageReadError(f"cannot read {path}: {exc}") from exc
    if data.ndim != 3:
        raise ImageReadError(f"{path}: expected a 3D image, got shape {data.shape}")
    spacing = tuple(float(s) for s in (fallback_spacing_zyx or (1.0, 1.0, 1.0)))
    return data, (spacing[0], spacing[1], spacing[2])


def write_nifti(path: Path, data_zyx: np.ndarray, spacing_zyx: tuple[float, ...]) -> None:
    """Write a (Z, Y, X) array as NIfTI with a diagonal affine of the given spacing."""
    import nibabel as nib

    affine = np.diag([spacing_zyx[2], spacing_zyx[1], spacing_zyx[0], 1.0])
    image = nib.Nifti1Image(np.ascontiguousarray(data_zyx.transpose(2, 1, 0)), affine)
    image.header.set_zooms((spacing_zyx[2], spacing_zyx[1], spacing_zyx[0]))
    nib.save(image, str(path))


def image_shape(path: Path) -> tuple[int, ...]:
    """The (Z, Y, X) shape from the file's header only (cheap: no voxel data is read).

    Lets the inference CLIs refuse an unreadable file or mismatching channels before they
    write anything.
    """
    ending = file_ending(path)
    try:
        if ending in (".nii.gz", ".nii"):
            import nibabel as nib

            shape = tuple(int(n) for n in nib.load(str(path)).shape)
        elif ending == ".npy":
            shape = tuple(int(n) for n in np.load(path, mmap_mode="r", allow_pickle=False).shape)
        elif ending == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                keys = list(archive.keys())
                shape = tuple(archive["data" if "data" in keys else keys[0]].shape)
        else:
            raise ImageReadError(f"{path}: unsupported file type {ending!r}")
    except ImageReadError:
        raise
    except Exception as exc:  # nibabel/numpy raise many types for broken files
        raise ImageReadError(f"cannot read {path}: {exc}") from exc
    if len(shape) != 3:
        raise ImageReadError(f"{path}: expected a 3D image, got shape {shape}")
    return shape[::-1] if ending in (".nii.gz", ".nii") else shape


def encode_like(data_zyx: np.ndarray, reference: Path, ending: str) -> bytes:
    """The bytes of a file holding data_zyx in the format `ending`, with the geometry of
    the image `reference` (for NIfTI: its header, affine, qform/sform and orientation).

    The caller writes them atomically. `.npy`/`.npz` carry no geometry (npz key `data`).
    """
    import io

    data_zyx = np.ascontiguousarray(data_zyx)
    if ending in (".nii.gz", ".nii"):
        import gzip

        import nibabel as nib

        source = nib.load(str(reference))
        header = source.header.copy()
        header.set_data_dtype(data_zyx.dtype)
        header.set_slope_inter(1.0, 0.0)  # labels are stored as they are, never scaled
        image = nib.Nifti1Image(data_zyx.transpose(2, 1, 0), source.affine, header)
        qform, qcode = source.get_qform(coded=True)
        sform, scode = source.get_sform(coded=True)
        image.set_qform(qform if qform is not None else source.affine, int(qcode or 0))
        image.set_sform(sform if sform is not None else source.affine, int(scode or 0))
        raw = image.to_bytes()
        # nibabel's own default level for .nii.gz.
        return gzip.compress(raw, compresslevel=1) if ending == ".nii.gz" else raw
    buffer = io.BytesIO()
    if ending == ".npy":
        np.save(buffer, data_zyx, allow_pickle=False)
    elif ending == ".npz":
        np.savez_compressed(buffer, data=data_zyx)
    else:
        raise ImageReadError(f"cannot write {ending!r} files")
    return buffer.getvalue()
