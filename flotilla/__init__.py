"""flotilla: every importable part lives under this one name (flotilla.kernels, flotilla.libs,
flotilla.services), so installing flotilla cannot shadow another distribution's top-level
package (Hugging Face's `kernels`, for one).

The design card's folders stay at the repository root (kernels/, libs/, services/). In a
checkout, flotilla/kernels, flotilla/libs and flotilla/services are symbolic links to them (what
type checkers and setuptools follow); an installed wheel holds the real folders here. Where a
copy of the checkout lost the links, the root itself is searched for the three packages.
"""

from pathlib import Path

_here = Path(__file__).resolve().parent
if not (_here / "services" / "__init__.py").is_file() and (
        _here.parent / "services" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821  (the package's own search path)
