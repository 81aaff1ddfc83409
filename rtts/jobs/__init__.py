"""Long-text jobs: whole chapters and books synthesized by workers on a Redis queue.

* :mod:`rtts.jobs.model` -- pure: configuration, splitting text into segments and
  chapters, job states, progress and time left.
* :mod:`rtts.jobs.store` -- the job records and the queue (Redis Streams, one consumer
  group of workers) and the segments' encoded audio (files under a shared directory).
* :mod:`rtts.jobs.worker` -- the worker: reads segments from the queue, synthesizes them at
  the scheduler's background priority, stores each one when complete.
"""

from rtts.jobs.model import JobsConfig, JobSplitter, JobState

__all__ = ["JobSplitter", "JobState", "JobsConfig"]
