"""LoongSage plugin: Asynchronous training schedulers: sync, no_window, window_gated, windowed_fifo."""

__version__ = "0.1.0"
