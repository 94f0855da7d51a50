"""The engine core: the loop, scheduler and block manager, and the after-step work, on plain records."""
