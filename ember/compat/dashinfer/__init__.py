"""DashInfer on ember: ``from ember.compat.dashinfer import allspark`` stands in for ``from dashinfer import
allspark``."""

from ember.compat.dashinfer import allspark

__all__ = ["allspark"]
