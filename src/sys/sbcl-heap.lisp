;;;; The heap, as SBCL's collector keeps it: what it holds, its size, the
;;;; time the collector has taken, and a collection of every generation.

(in-package #:hunchentoot-recycling-taskmaster)

(defun garbage-collection-time ()
  "The internal time units SBCL's garbage collector has run, every thread
stopped, since the process began."
  sb-ext:*gc-run-time*)

(defun heap-octets-used ()
  "The octets the heap holds now, live or not yet collected."
  (sb-kernel:dynamic-usage))

(defun heap-octets ()
  "The heap's size: the dynamic space."
  (sb-ext:dynamic-space-size))

(defun collect-every-generation ()
  "Collect the whole heap, every thread stopped."
  (sb-ext:gc :full t))
