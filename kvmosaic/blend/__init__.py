"""Segment reuse beyond prefixes: position re-rotation, deviation scoring, selective recompute."""

from .blender import Blender, BlendOptions, BlendResult
from .prompt import SegmentedPrompt, SegmentSpan, parse_segment_prompt, split_on_separator
from .store import SegmentKVStore

__all__ = ["BlendOptions", "Blender", "BlendResult", "SegmentKVStore", "SegmentSpan", "SegmentedPrompt",
           "parse_segment_prompt", "split_on_separator"]
