;;;; Deadlines: SBCL ends every wait a thread makes inside WITH-DEADLINE -- a
;;;; socket read or write, a mutex, a condition variable -- once the deadline
;;;; passes, by a DEADLINE-PASSED signalled in that thread from inside the
;;;; wait.  No thread is interrupted by another.

(in-package #:hunchentoot-recycling-taskmaster)

(deftype deadline-passed ()
  "The condition a wait signals when the deadline of WITH-DEADLINE has passed."
  'sb-sys:deadline-timeout)

(defmacro with-deadline ((seconds) &body body)
  "Run BODY with each wait in it ended SECONDS from now by DEADLINE-PASSED."
  `(sb-sys:with-deadline (:seconds ,seconds :override t) ,@body))
