"""The one module that knows image file formats, chosen by the file ending as nnU-Net 2.8.1
chooses its reader (dataset.json's `file_ending`):

- NIfTI (`.nii.gz`, `.nii`) via nibabel (2D, 3D, or 4D = one channel per volume);
- `.nrrd`, `.mha`, `.mhd`, `.gipl` via SimpleITK (2D, 3D, or 4D = one channel per volume);
- `.png`, `.bmp` natural 2D images via Pillow: grey is one channel, RGB three, RGBA four
  (what nnU-Net's natural-image reader accepts); spacing (999, 1, 1);
- `.tif`, `.tiff` via tifffile: a 2D image (grey or RGB(A)) as PNG, or a 3D volume whose
  spacing is in `CASE.json` beside it (`{"spacing": [z, y, x]}`, nnU-Net's tif rule);
- `.npy`, `.npz`: no geometry; spacing from dataset.json's "spacing" (z, y, x), else 1 mm.

Arrays are numpy (C, Z, Y, X) with spacing (z, y, x) in mm, the axis order of nnU-Net's
SimpleITK reader (NIfTI stores x, y, z: we transpose). A 2D image is (C, 1, Y, X) with a
slice spacing far larger than the in-plane ones (999 x), as nnU-Net. Every problem with a
file is an `ImageReadError` naming it; the format libraries are imported where used.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from trainer.data import image_formats as fmt

SUPPORTED_ENDINGS = (".nii.gz", ".nii", *fmt.SITK_ENDINGS, *fmt.NATURAL_ENDINGS,
                     *fmt.TIFF_ENDINGS, ".npy", ".npz")  # fmt: skip
# A file of these formats may hold several channels (RGB, 4D): counted from the headers.
MULTI_CHANNEL_ENDINGS = tuple(e for e in SUPPORTED_ENDINGS if e not in (".npy", ".npz"))
SPACING_RTOL = 1e-3
_CHANNEL_SUFFIX = re.compile(r"_\d{4}$")

ImageReadError = fmt.ImageReadError
Spacing = tuple[float, float, float]


def file_ending(path: Path) -> str:
    """The file's ending as written (`.nii.gz` before `.nii`; `.PNG` matches `.png`)."""
    name = Path(path).name
    for ending in SUPPORTED_ENDINGS:
        if name.lower().endswith(ending):
            return name[-len(ending) :]
    return Path(path).suffix


def check_file_ending(ending: str) -> None:
    """ImageReadError unless nnui reads files ending in `ending` (dataset.json's)."""
    if not isinstance(ending, str) or ending.lower() not in SUPPORTED_ENDINGS:
        raise ImageReadError(
            f"file_ending {ending!r} is not an image format nnui reads "
            f"({', '.join(SUPPORTED_ENDINGS)})"
        )


# nnU-Net's reader classes that read as the file ending's reader here (no reorientation).
SAME_AS_ENDING_READERS = ("SimpleITKIO", "NibabelIO", "NaturalImage2DIO", "Tiff3DIO")


def check_reader_override(name: object) -> None:
    """dataset.json's `overwrite_image_reader_writer` (nnU-Net's way to pick a reader by
    class): one that reads as the ending's reader is fine; a reorienting or custom one
    would give other arrays than nnU-Net's, so it is refused rather than ignored."""
    if name in (None, "None") or name in SAME_AS_ENDING_READERS:
        return
    raise ImageReadError(
        f"overwrite_image_reader_writer {name!r}: nnui reads by file_ending as "
        f"{', '.join(SAME_AS_ENDING_READERS)} do (no reorientation); remove the entry"
    )


def _kind(path: Path) -> str:
    ending = file_ending(path).lower()
    for kind, endings in (("nifti", (".nii.gz", ".nii")), ("sitk", fmt.SITK_ENDINGS),
                          ("natural", fmt.NATURAL_ENDINGS), ("tiff", fmt.TIFF_ENDINGS),
                          ("numpy", (".npy", ".npz"))):  # fmt: skip
        if ending in endings:
            return kind
    raise ImageReadError(f"{path}: unsupported file type {file_ending(path)!r}")


def spacing_file(path: Path, channel_file: bool | None) -> Path:
    """The JSON beside a 3D TIFF: `CASE.json` for `CASE_0000.tif` (a channel file) and for
    `CASE.tif` (a segmentation). None: whichever exists, the file's own name first."""
    stem = Path(path).name[: -len(file_ending(path))]
    own = Path(path).with_name(f"{stem}.json")
    case = Path(path).with_name(f"{_CHANNEL_SUFFIX.sub('', stem)}.json")
    if channel_file is None:
        return own if own.is_file() or not _CHANNEL_SUFFIX.search(stem) else case
    return case if channel_file else own


def _tiff_spacing(path: Path, channel_file: bool | None) -> Spacing:
    sidecar = spacing_file(path, channel_file)
    try:
        spacing = json.loads(sidecar.read_text())["spacing"]
        values = tuple(float(s) for s in spacing)
    except FileNotFoundError:
        raise ImageReadError(
            f'3D TIFF {path} has no spacing file {sidecar} (write {{"spacing": [z, y, x]}})'
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ImageReadError(f"{sidecar}: no readable 'spacing' ({exc})") from None
    if len(values) != 3 or not all(np.isfinite(v) and v > 0 for v in values):
        raise ImageReadError(f"{sidecar}: spacing must be 3 positive numbers, got {spacing}")
    return values[0], values[1], values[2]


def _read_numpy(path: Path) -> np.ndarray:
    if file_ending(path).lower() == ".npy":
        return np.load(path, allow_pickle=False)
    with np.load(path, allow_pickle=False) as archive:
        keys = list(archive.keys())
        return archive["data"] if "data" in keys else archive[keys[0]]


def _read_file(
    path: Path, fallback_spacing: tuple[float, ...] | None, channel_file: bool | None
) -> tuple[np.ndarray, Spacing]:
    """(C, Z, Y, X) and spacing of one file, whatever its format."""
    kind = _kind(path)
    try:
        if kind == "nifti":
            data, spacing = fmt.read_nifti(path)
        elif kind == "sitk":
            data, spacing = fmt.read_sitk(path)
        elif kind == "natural":
            data, spacing = fmt.read_natural(path), fmt.NATURAL_SPACING
        elif kind == "tiff":
            data, is_2d = fmt.read_tiff(path)
            spacing = fmt.NATURAL_SPACING if is_2d else _tiff_spacing(path, channel_file)
        else:
            data = _read_numpy(path)
            if data.ndim != 3:
                raise ImageReadError(f"{path}: expected a 3D image, got shape {data.shape}")
            data = data[None]
            spacing = tuple(float(s) for s in (fallback_spacing or (1.0, 1.0, 1.0)))[:3]
    except ImageReadError:
        raise
    except Exception as exc:  # the format libraries raise many types for broken files
        raise ImageReadError(f"cannot read {path}: {_reason(path, exc)}") from exc
    if data.dtype == np.bool_:
        data = data.astype(np.uint8)
    return data, (float(spacing[0]), float(spacing[1]), float(spacing[2]))


def _one_line(exc: Exception) -> str:
    """SimpleITK's messages span lines; the CLIs print one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else repr(exc)


def _reason(path: Path, exc: Exception) -> str:
    """ITK ends a failed read of an existing but truncated file with a stale errno
    ("No such file or directory"): say what is wrong with the file instead."""
    text = _one_line(exc)
    if "No such file or directory" in text and path.is_file():
        return (
            f"the file is truncated or corrupt ({path.stat().st_size} bytes): its voxel "
            "data cannot be read (copy it again or export it anew)"
        )
    return text


def read_case(
    paths: tuple[Path, ...] | list[Path], fallback_spacing: tuple[float, ...] | None = None
) -> tuple[np.ndarray, Spacing]:
    """The image of a case: its channel files (`CASE_0000<ending>`, ...) read and stacked
    in order, (C, Z, Y, X) float32, and the spacing. Every file must be numeric and
    finite, of channel 0's shape and spacing."""
    arrays, spacing, shape = [], None, None
    for path in paths:
        data, file_spacing = _read_file(Path(path), fallback_spacing, channel_file=True)
        if shape is None or spacing is None:  # channel 0 (sets both)
            shape, spacing = data.shape[1:], file_spacing
        elif data.shape[1:] != shape:
            raise ImageReadError(
                f"{path}: shape {list(data.shape[1:])} differs from channel 0's {list(shape)}"
            )
        elif not np.allclose(file_spacing, spacing, rtol=SPACING_RTOL):
            raise ImageReadError(
                f"{path}: spacing {file_spacing} differs from channel 0's {spacing}"
            )
        if not np.issubdtype(data.dtype, np.number):
            raise ImageReadError(f"{path}: not a numeric image (dtype {data.dtype})")
        if not np.isfinite(data).all():
            raise ImageReadError(f"{path}: image contains NaN or inf values")
        arrays.append(data)
    if not arrays:
        raise ImageReadError("a case without image files")
    image = np.concatenate(arrays).astype(np.float32, copy=False)
    assert spacing is not None
    return image, spacing


def read_image(
    path: Path, fallback_spacing: tuple[float, ...] | None = None
) -> tuple[np.ndarray, Spacing]:
    """One single-channel image (a segmentation, or one channel file), (Z, Y, X) in its
    own dtype, and its spacing (z, y, x)."""
    data, spacing = _read_file(Path(path), fallback_spacing, channel_file=None)
    if data.shape[0] != 1:
        raise ImageReadError(f"{path} holds {data.shape[0]} channels where one is expected")
    return data[0], spacing


def read_labels(path: Path) -> np.ndarray:
    """A segmentation's voxels only (Z, Y, X): a 3D TIFF needs no spacing file here."""
    path = Path(path)
    if _kind(path) == "tiff":
        try:
            data = fmt.read_tiff(path)[0]
        except ImageReadError:
            raise
        except Exception as exc:  # tifffile raises many types for broken files
            raise ImageReadError(f"cannot read {path}: {_one_line(exc)}") from exc
        if data.shape[0] != 1:
            raise ImageReadError(f"{path} holds {data.shape[0]} channels where one is expected")
        return data[0]
    return read_image(path)[0]


def image_header(path: Path) -> tuple[int, tuple[int, int, int]]:
    """(number of channels, (Z, Y, X)) from the file's header only (no voxel data is read):
    lets the CLIs refuse an unreadable file or a wrong channel count before writing."""
    path = Path(path)
    kind = _kind(path)
    try:
        if kind == "nifti":
            channels, shape = fmt.nifti_header(path)
        elif kind == "sitk":
            channels, shape = fmt.sitk_header(path)
        elif kind == "natural":
            channels, shape = fmt.natural_header(path)
        elif kind == "tiff":
            channels, shape = fmt.tiff_header(path)
        else:
            shape = tuple(int(n) for n in fmt.numpy_shape(path))
            if len(shape) != 3:
                raise ImageReadError(f"{path}: expected a 3D image, got shape {shape}")
            channels = 1
    except ImageReadError:
        raise
    except Exception as exc:  # the format libraries raise many types for broken files
        raise ImageReadError(f"cannot read {path}: {_one_line(exc)}") from exc
    return channels, (int(shape[0]), int(shape[1]), int(shape[2]))


def check_spacing_file(path: Path) -> None:
    """ImageReadError when `path` (a channel file) is a 3D TIFF without its spacing file:
    found before anything is written, not when the case's turn comes."""
    path = Path(path)
    if _kind(path) != "tiff":
        return
    try:
        is_2d = fmt.tiff_is_2d(path)
    except ImageReadError:
        raise
    except Exception as exc:  # tifffile raises many types for broken files
        raise ImageReadError(f"cannot read {path}: {_one_line(exc)}") from exc
    if not is_2d:
        _tiff_spacing(path, channel_file=True)


def image_shape(path: Path) -> tuple[int, int, int]:
    """The (Z, Y, X) shape from the file's header only."""
    return image_header(path)[1]


def write_nifti(path: Path, data_zyx: np.ndarray, spacing_zyx: tuple[float, ...]) -> None:
    """Write a (Z, Y, X) array as NIfTI with a diagonal affine of the given spacing."""
    fmt.write_nifti(Path(path), data_zyx, spacing_zyx)


def encode_like(data_zyx: np.ndarray, reference: Path, out_path: Path) -> list[tuple[Path, bytes]]:
    """The files holding the segmentation data_zyx at `out_path`, in the format of its
    ending and with the geometry of the image `reference` (a channel file of the case, or
    a segmentation written before): [(path, bytes)], the segmentation itself last, so a
    caller writing them in order (atomically) leaves it as the mark of a complete case.

    NIfTI keeps the reference's header and affine; SimpleITK formats its spacing, origin
    and direction; a 3D TIFF gets the spacing file beside it; PNG/BMP/2D TIFF and .npy/.npz
    carry no geometry (npz key `data`)."""
    reference, out_path = Path(reference), Path(out_path)
    data_zyx = np.ascontiguousarray(data_zyx)
    kind = _kind(out_path)
    try:
        if kind == "nifti":
            return [(out_path, fmt.nifti_bytes_like(data_zyx, reference, out_path))]
        if kind == "sitk":
            return fmt.sitk_files_like(data_zyx, reference, out_path)
        if kind == "natural":
            return [(out_path, fmt.natural_bytes(data_zyx, out_path))]
        if kind == "tiff":
            if data_zyx.shape[0] == 1 and fmt.tiff_is_2d(reference):
                return [(out_path, fmt.tiff_bytes(data_zyx[0]))]
            spacing = list(_tiff_spacing(reference, None))
            sidecar = spacing_file(out_path, channel_file=False)
            text = json.dumps({"spacing": spacing}) + "\n"
            return [(sidecar, text.encode()), (out_path, fmt.tiff_bytes(data_zyx))]
    except ImageReadError:
        raise
    except Exception as exc:  # the reference's format library, on a broken reference
        raise ImageReadError(f"cannot write {out_path} like {reference}: {exc}") from exc
    return [(out_path, fmt.numpy_bytes(data_zyx, out_path))]
