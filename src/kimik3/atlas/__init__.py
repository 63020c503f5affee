"""How the model is built, computed from the live modules: exact parameter accounting (`params`) and the
architecture atlas (`build.build_atlas` -> atlas.json, `render.write_site` -> a static site; `kimik3 atlas`)."""

from kimik3.atlas.params import ParamReport, count_parameters, format_report

__all__ = ["ParamReport", "count_parameters", "format_report"]
