"""The fault campaigns: seeded model (seeds), seeded in-process stack (stack) with bus faults
(busfaults), real processes with SIGKILLs (processes), their shared oracles, and the command."""
