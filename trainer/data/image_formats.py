"""Per-format readers and writers behind `trainer.data.image_io` (the only module that
imports this one; everything else goes through image_io, which picks the format).

Each reader returns (C, Z, Y, X) in the file's dtype; headers are read without voxels.
The libraries (nibabel, SimpleITK, Pillow, tifffile) are imported where used: a NIfTI
dataset never loads the others.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np

SITK_ENDINGS = (".nrrd", ".mha", ".mhd", ".gipl")
NATURAL_ENDINGS = (".png", ".bmp")
TIFF_ENDINGS = (".tif", ".tiff")
# nnU-Net's spacing of a 2D natural image: the slice axis far coarser than the pixels.
NATURAL_SPACING = (999.0, 1.0, 1.0)
SLICE_FACTOR_2D = 999.0


class ImageReadError(ValueError):
    """A file that cannot be read (or written) as an image; the message names the file."""


# ---- NIfTI (nibabel) ---------------------------------------------------------------------


def _nifti_layout(path: Path, shape_xyz: tuple[int, ...], zooms: tuple[float, ...]):
    """(channels, (Z, Y, X), spacing zyx) as nnU-Net's SimpleITK reader lays out a NIfTI:
    2D -> one slice of 999 x the largest pixel spacing; 4D -> one channel per volume."""
    zooms = tuple(abs(float(z)) for z in zooms)
    if len(shape_xyz) == 2:
        slice_mm = SLICE_FACTOR_2D * max(zooms[:2])
        return 1, (1, shape_xyz[1], shape_xyz[0]), (slice_mm, zooms[1], zooms[0])
    if len(shape_xyz) in (3, 4):
        channels = shape_xyz[3] if len(shape_xyz) == 4 else 1
        return channels, tuple(shape_xyz[2::-1]), zooms[2::-1]
    raise ImageReadError(f"{path}: a {len(shape_xyz)}D image; nnui reads 2D, 3D and 4D")


def read_nifti(path: Path) -> tuple[np.ndarray, tuple[float, ...]]:
    import nibabel as nib

    image = nib.load(str(path))
    shape = tuple(int(n) for n in image.shape)
    channels, shape_zyx, spacing = _nifti_layout(path, shape, image.header.get_zooms())
    data = np.asarray(image.dataobj)
    return np.ascontiguousarray(data.T).reshape(channels, *shape_zyx), spacing


def nifti_header(path: Path) -> tuple[int, tuple[int, ...]]:
    import nibabel as nib

    image = nib.load(str(path))
    channels, shape_zyx, _ = _nifti_layout(path, tuple(int(n) for n in image.shape),
                                           image.header.get_zooms())  # fmt: skip
    return channels, shape_zyx


def write_nifti(path: Path, data_zyx: np.ndarray, spacing_zyx: tuple[float, ...]) -> None:
    import nibabel as nib

    affine = np.diag([spacing_zyx[2], spacing_zyx[1], spacing_zyx[0], 1.0])
    image = nib.Nifti1Image(np.ascontiguousarray(data_zyx.transpose(2, 1, 0)), affine)
    image.header.set_zooms((spacing_zyx[2], spacing_zyx[1], spacing_zyx[0]))
    nib.save(image, str(path))


def nifti_bytes_like(data_zyx: np.ndarray, reference: Path, out_path: Path) -> bytes:
    """NIfTI bytes with the reference's header, affine, qform/sform and orientation."""
    import gzip

    import nibabel as nib

    source = nib.load(str(reference))
    # A 2D reference gets a 2D file; a 4D one (channels) a 3D file of its first volume's.
    voxels = data_zyx[0].T if len(source.shape) == 2 else data_zyx.transpose(2, 1, 0)
    header = source.header.copy()
    header.set_data_shape(voxels.shape)
    header.set_data_dtype(data_zyx.dtype)
    header.set_slope_inter(1.0, 0.0)  # labels are stored as they are, never scaled
    image = nib.Nifti1Image(voxels, source.affine, header)
    qform, qcode = source.get_qform(coded=True)
    sform, scode = source.get_sform(coded=True)
    image.set_qform(qform if qform is not None else source.affine, int(qcode or 0))
    image.set_sform(sform if sform is not None else source.affine, int(scode or 0))
    raw = image.to_bytes()
    # nibabel's own default level for .nii.gz.
    return gzip.compress(raw, compresslevel=1) if out_path.name.lower().endswith(".gz") else raw


# ---- SimpleITK: .nrrd .mha .mhd .gipl --------------------------------------------------


def _sitk_layout(path: Path, size_xyz: tuple[int, ...], spacing_xyz: tuple[float, ...],
                 components: int) -> tuple[int, tuple[int, ...], tuple[float, ...]]:  # fmt: skip
    """(channels, (Z, Y, X), spacing zyx) as nnU-Net's SimpleITK reader lays a file out:
    2D -> one slice of 999 x the largest pixel spacing; 4D -> one channel per volume."""
    if components != 1:
        raise ImageReadError(
            f"{path} has {components} values per voxel (a vector image); nnui reads one "
            "value per voxel (store channels as CASE_0000, CASE_0001, ...)"
        )
    spacing = tuple(abs(float(s)) for s in spacing_xyz)
    if len(size_xyz) == 2:
        slice_mm = SLICE_FACTOR_2D * max(spacing)
        return 1, (1, size_xyz[1], size_xyz[0]), (slice_mm, spacing[1], spacing[0])
    if len(size_xyz) == 3:
        return 1, tuple(size_xyz[::-1]), spacing[::-1]
    if len(size_xyz) == 4:
        return size_xyz[3], tuple(size_xyz[2::-1]), spacing[2::-1]
    raise ImageReadError(f"{path}: a {len(size_xyz)}D image; nnui reads 2D, 3D and 4D")


def read_sitk(path: Path) -> tuple[np.ndarray, tuple[float, ...]]:
    import SimpleITK as sitk

    image = sitk.ReadImage(str(path))
    channels, shape, spacing = _sitk_layout(path, image.GetSize(), image.GetSpacing(),
                                            image.GetNumberOfComponentsPerPixel())  # fmt: skip
    data = sitk.GetArrayFromImage(image)
    return data.reshape(channels, *shape), spacing


def sitk_header(path: Path) -> tuple[int, tuple[int, ...]]:
    import SimpleITK as sitk

    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    reader.ReadImageInformation()
    channels, shape, _ = _sitk_layout(path, reader.GetSize(), reader.GetSpacing(),
                                      reader.GetNumberOfComponents())  # fmt: skip
    return channels, shape


def sitk_files_like(data_zyx: np.ndarray, reference: Path, out_path: Path) -> list:
    """[(path, bytes)] of the segmentation in the reference's dimension, spacing, origin
    and direction (a 4D reference: its first volume's); `.mhd` gets its data file first."""
    import SimpleITK as sitk

    reader = sitk.ImageFileReader()
    reader.SetFileName(str(reference))
    reader.ReadImageInformation()
    dim = min(reader.GetDimension(), 3)
    data = data_zyx[0] if dim == 2 else data_zyx
    image = sitk.GetImageFromArray(data.astype(_label_dtype(data), copy=False))
    full = reader.GetDimension()
    image.SetSpacing(reader.GetSpacing()[:dim])
    image.SetOrigin(reader.GetOrigin()[:dim])
    direction = np.asarray(reader.GetDirection()).reshape(full, full)[:dim, :dim]
    image.SetDirection(tuple(float(v) for v in direction.ravel()))
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".nnui-") as folder:
        sitk.WriteImage(image, str(Path(folder) / out_path.name), True)
        files = sorted(Path(folder).iterdir(), key=lambda p: p.name == out_path.name)
        return [(out_path.with_name(p.name), p.read_bytes()) for p in files]


def _label_dtype(data: np.ndarray) -> type:
    return np.uint8 if data.size == 0 or int(data.max()) < 255 else np.uint16


# ---- natural 2D images: .png .bmp (and 2D .tif) --------------------------------------


def _natural_mode(image, path: Path):
    """The image in the mode nnU-Net's reader sees (a palette as its palette's colours,
    a PNG 'I' as 16 bit) and its channel count: grey 1, RGB 3, RGBA 4; others refused."""
    if image.mode == "P":
        image = image.convert(image.palette.mode)
    elif image.mode == "I" and image.format == "PNG":
        image = image.convert("I;16")
    bands = len(image.getbands())
    _check_bands(path, image.mode, bands)
    return image, bands


def _check_bands(path: Path, mode: str, bands: int) -> None:
    if bands not in (1, 3, 4):  # nnU-Net's natural reader: 2D grey, or 3/4 colour channels
        raise ImageReadError(
            f"{path} is a {mode} image ({bands} channels): nnui reads grey, RGB or RGBA 2D images"
        )


def read_natural(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as opened:
        image, bands = _natural_mode(opened, path)
        data = np.asarray(image)
    return _channels_first(data, bands)


def natural_header(path: Path) -> tuple[int, tuple[int, ...]]:
    from PIL import Image

    with Image.open(path) as opened:
        width, height = opened.size
        mode = opened.palette.mode if opened.mode == "P" and opened.palette else opened.mode
    _check_bands(path, mode, Image.getmodebands(mode))
    return Image.getmodebands(mode), (1, height, width)


def _channels_first(data: np.ndarray, bands: int) -> np.ndarray:
    if bands == 1:
        return data.reshape(1, 1, *data.shape[:2])
    return np.ascontiguousarray(np.moveaxis(data, -1, 0))[:, None]


def natural_bytes(data_zyx: np.ndarray, out_path: Path) -> bytes:
    from PIL import Image

    if data_zyx.shape[0] != 1:
        slices = data_zyx.shape[0]
        raise ImageReadError(f"{out_path}: a 2D image format for a {slices}-slice volume")
    plane = data_zyx[0].astype(_label_dtype(data_zyx), copy=False)
    buffer = io.BytesIO()
    image_format = "BMP" if out_path.suffix.lower() == ".bmp" else "PNG"
    Image.fromarray(plane).save(buffer, format=image_format)
    return buffer.getvalue()


# ---- TIFF: 2D natural images or 3D volumes (tifffile) ----------------------------------


def _tiff_layout(path: Path, shape: tuple[int, ...], axes: str) -> tuple[int, bool]:
    """(channels, is 2D): 2D grey (YX), 2D RGB(A) (YXS, as nnU-Net's natural reader),
    or a 3D volume (one channel, any other 3-axis layout)."""
    if len(shape) == 2:
        return 1, True
    if len(shape) == 3 and axes.endswith("S"):
        if shape[-1] not in (3, 4):
            raise ImageReadError(f"{path}: {shape[-1]} samples per pixel; nnui reads 1, 3 or 4")
        return shape[-1], True
    if len(shape) == 3:
        return 1, False
    raise ImageReadError(f"{path}: a TIFF of shape {list(shape)}; nnui reads 2D and 3D TIFFs")


def read_tiff(path: Path) -> tuple[np.ndarray, bool]:
    """((C, Z, Y, X), is 2D)."""
    import tifffile

    with tifffile.TiffFile(path) as tiff:
        series = tiff.series[0]
        channels, is_2d = _tiff_layout(path, tuple(series.shape), series.axes)
        data = series.asarray()
    return (_channels_first(data, channels) if is_2d else data[None]), is_2d


def tiff_header(path: Path) -> tuple[int, tuple[int, ...]]:
    import tifffile

    with tifffile.TiffFile(path) as tiff:
        shape, axes = tuple(int(n) for n in tiff.series[0].shape), tiff.series[0].axes
    channels, is_2d = _tiff_layout(path, shape, axes)
    return channels, ((1, shape[0], shape[1]) if is_2d else shape)


def tiff_is_2d(path: Path) -> bool:
    import tifffile

    with tifffile.TiffFile(path) as tiff:
        shape, axes = tuple(tiff.series[0].shape), tiff.series[0].axes
    return _tiff_layout(path, shape, axes)[1]


def tiff_bytes(data: np.ndarray) -> bytes:
    """2D (Y, X) or 3D (Z, Y, X) labels, zlib-compressed, never taken for RGB samples."""
    import tifffile

    buffer = io.BytesIO()
    tifffile.imwrite(buffer, data.astype(_label_dtype(data), copy=False),
                     compression="zlib", photometric="minisblack")  # fmt: skip
    return buffer.getvalue()


# ---- .npy / .npz -------------------------------------------------------------------


def numpy_shape(path: Path) -> tuple[int, ...]:
    if path.name.lower().endswith(".npy"):
        return tuple(np.load(path, mmap_mode="r", allow_pickle=False).shape)
    with np.load(path, allow_pickle=False) as archive:
        keys = list(archive.keys())
        return tuple(archive["data" if "data" in keys else keys[0]].shape)


def numpy_bytes(data_zyx: np.ndarray, out_path: Path) -> bytes:
    buffer = io.BytesIO()
    if out_path.name.lower().endswith(".npy"):
        np.save(buffer, data_zyx, allow_pickle=False)
    else:
        np.savez_compressed(buffer, data=data_zyx)
    return buffer.getvalue()
