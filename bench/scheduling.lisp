;;;; Ours with each worker scheduling policy (RECYCLING-TASKMASTER's
;;;; :WORKER-SCHEDULING-POLICY), side by side on the handler workloads of
;;;; the matrix: what SCHED_BATCH, whose woken workers do not preempt the
;;;; one running, gains and costs against the kernel's default.
;;;; `bench/run scheduling` measures it.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defun scheduling-server (policy)
  "The matrix's server entry for ours with its workers under POLICY."
  (list :name (format nil "parallel-~(~A~)" policy)
        :label (format nil "parallel-easy-acceptor, workers ~A" policy)
        :lisp :parallel
        :serve-options (list :worker-scheduling-policy policy)))

(defun run-scheduling (&key core (rounds 3))
  "The handler workloads of the matrix for ours with its workers under
SCHED_OTHER and under SCHED_BATCH, round by round in one run, the first the
baseline.  Writes bench/results/<UTC timestamp>-scheduling/."
  (run-benchmarks :core core :peers nil :rounds rounds
                  :servers (list (scheduling-server :other) (scheduling-server :batch))
                  :workloads (remove-if (lambda (workload) (getf workload :file)) (workloads nil))
                  :run-name (format nil "~A-scheduling" (utc-timestamp))))
