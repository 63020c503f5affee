"""How the model is built, computed from the live modules: parameter accounting (and later the atlas)."""

from kimik3.atlas.params import ParamReport, count_parameters, format_report

__all__ = ["ParamReport", "count_parameters", "format_report"]
