"""Analysis: the spectrum of the attention matrix (paper Figure 1) and attention maps."""

from .maps import attention_map, write_attention_map
from .report import SpectrumSettings, spectrum_report
from .spectrum import Spectra, attention_spectra, cost_ratio, cumulative_spectrum, mass_rank

__all__ = [
    "Spectra",
    "SpectrumSettings",
    "attention_map",
    "attention_spectra",
    "cost_ratio",
    "cumulative_spectrum",
    "mass_rank",
    "spectrum_report",
    "write_attention_map",
]
