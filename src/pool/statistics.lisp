;;;; Observing a running pool.

(in-package #:hunchentoot-recycling-taskmaster)

(defmethod hunchentoot:taskmaster-thread-count ((taskmaster recycling-taskmaster))
  (pool-thread-count taskmaster))

(defgeneric taskmaster-statistics (taskmaster)
  (:documentation "A fresh plist describing TASKMASTER's pool (TASKMASTER may
also be a PARALLEL-ACCEPTOR, meaning its taskmaster) now, cheap enough to
poll: the pool's counts, then, once the taskmaster has been started, the
engine's.  Its keys, and what each counts, are *STATISTICS-KEYS*'s (the
table of docs/operations.md); counts named ..._total in Prometheus are
totals since the taskmaster was made.  PROMETHEUS-METRICS formats them.
The order of keys is unspecified.  The pool's counts are taken under its
lock in one go; the engine's counts and :REQUESTS-SERVED may lag by the
work finishing while they are read."))

(defmethod taskmaster-statistics ((taskmaster recycling-taskmaster))
  (let ((engine (taskmaster-engine taskmaster)))
    (append
     (with-pool-lock (taskmaster)
       (let ((idle (+ (waiting-worker-count taskmaster) (resting-count taskmaster))))
         (list :threads (pool-thread-count taskmaster)
               :busy-threads (max 0 (- (pool-thread-count taskmaster) idle))
               :accepting-threads idle
               :resting-threads (resting-count taskmaster)
               :in-request-threads (in-request-count taskmaster)
               :requests-served (+ (retired-requests-served taskmaster)
                                   (reduce #'+ (pool-workers taskmaster) :key #'worker-requests-served))
               :threads-created (threads-created taskmaster)
               :threads-retired (threads-retired taskmaster)
               :peak-threads (peak-thread-count taskmaster)
               :growth-declined (growth-declined-count taskmaster)
               :heap-collections (heap-guard-collections **heap-guard**))))
     (and engine (engine-statistics engine)))))

(defmethod taskmaster-statistics ((acceptor parallel-acceptor))
  "The statistics of ACCEPTOR's taskmaster, for code that holds the acceptor
(Hunchentoot does not export the taskmaster reader)."
  (taskmaster-statistics (acceptor-taskmaster acceptor)))
