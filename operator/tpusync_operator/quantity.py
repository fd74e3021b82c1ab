"""Kubernetes resource quantities ("64Gi", "500G", "1.5Ti") to integer bytes."""

from __future__ import annotations

import re
from decimal import Decimal

# A deliberately small subset of the Kubernetes quantity grammar: what byte sizes need.
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$"

_SUFFIX = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_RE = re.compile(r"^(?P<num>[0-9]+(?:\.[0-9]+)?)(?P<suffix>[KMGTPE]i|[kMGTPE])?$")


def to_bytes(quantity: str | int) -> int:
    """Parse a byte quantity; raises ValueError on anything else. Fractions round up."""
    if isinstance(quantity, int):
        if quantity < 0:
            raise ValueError(f"negative quantity {quantity}")
        return quantity
    m = _RE.match(quantity.strip())
    if not m:
        raise ValueError(f"not a byte quantity: {quantity!r}")
    value = Decimal(m["num"]) * _SUFFIX[m["suffix"] or ""]
    return int(value.to_integral_value(rounding="ROUND_CEILING"))
