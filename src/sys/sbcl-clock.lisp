;;;; A clock fine enough to time one request.  SBCL's GET-INTERNAL-REAL-TIME
;;;; reads CLOCK_MONOTONIC_COARSE on Linux, which moves once per kernel
;;;; tick: on this machine in steps of 4 ms, so that a request of 1 ms reads
;;;; 0 or 4000 microseconds.  Deadlines of seconds are fine with it;
;;;; durations of requests are not.  And the time of day with the
;;;; microseconds of its second, to tell when a second ends.

(in-package #:hunchentoot-recycling-taskmaster)

(declaim (inline monotonic-microseconds))
(defun monotonic-microseconds ()
  "Microseconds on CLOCK_MONOTONIC, from an unspecified start."
  (multiple-value-bind (seconds nanoseconds) (sb-unix::clock-gettime +clock-monotonic+)
    (+ (* seconds 1000000) (floor nanoseconds 1000))))

(defun universal-time-and-microseconds ()
  "The universal time now, and the microseconds of its second gone."
  (multiple-value-bind (seconds microseconds) (sb-ext:get-time-of-day)
    (values (+ seconds +unix-epoch-universal-time+) microseconds)))
