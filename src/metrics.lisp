;;;; TASKMASTER-STATISTICS in the Prometheus text exposition format, for a
;;;; monitoring system to scrape; the families are *STATISTICS-KEYS*'s.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *refusals-help*
  "Requests the engine answered by itself, without a handler, by status."
  "The help text of the family of refusals, which share it.")

(defun write-metric-family (stream name type help)
  (format stream "# HELP ~A ~A~%# TYPE ~A ~(~A~)~%" name help name type))

(defun metric-number (number)
  "NUMBER as Prometheus reads a sample value: decimal, no exponent marker."
  (if (integerp number)
      (princ-to-string number)
      (let ((*read-default-float-format* 'double-float))
        (string-right-trim "." (string-right-trim "0" (format nil "~,6F" number))))))

(defun write-refusals (stream statistics prefix)
  "The family counting the requests refused, one sample per status."
  (let ((name (concatenate 'string prefix "refused_requests_total")))
    (write-metric-family stream name 'counter *refusals-help*)
    (loop for (key kind) in *statistics-keys*
          when (consp kind)
            do (format stream "~A{status=\"~D\"} ~D~%" name (second kind) (getf statistics key 0)))))

(defun write-histogram (stream statistics name help)
  "The request-duration histogram: its buckets, +Inf, sum and count."
  (write-metric-family stream name 'histogram help)
  (loop for (bound . count) in (getf statistics :request-duration-buckets)
        do (format stream "~A_bucket{le=\"~A\"} ~D~%" name (metric-number bound) count))
  (format stream "~A_bucket{le=\"+Inf\"} ~D~%~A_sum ~A~%~A_count ~D~%"
          name (getf statistics :request-duration-count)
          name (metric-number (getf statistics :request-duration-seconds))
          name (getf statistics :request-duration-count)))

(defun prometheus-metrics (acceptor &key (prefix "hunchentoot_recycling_"))
  "TASKMASTER-STATISTICS of ACCEPTOR (or of a RECYCLING-TASKMASTER) as a
string in the Prometheus text exposition format (version 0.0.4): each
family with # HELP and # TYPE, counters named ..._total, gauges, the
engine's replies by status class and refusals by status, TLS handshakes
by protocol, HTTP/2 GOAWAYs by cause, and a histogram of request durations (from the complete head
to the flushed reply) with its _bucket, _sum and _count.  Every name starts with PREFIX.  Serve it
with Content-Type text/plain; version=0.0.4.  Unspecified: the order of
the families.  Families of the engine appear once it has been started."
  (let ((statistics (taskmaster-statistics acceptor))
        (refusals-written-p nil))
    (with-output-to-string (out)
      (loop for (key kind name help) in *statistics-keys*
            for full-name = (concatenate 'string prefix name)
            when (getf statistics key)
              do (cond ((member kind '(:gauge :counter))
                        (write-metric-family out full-name kind help)
                        (format out "~A ~D~%" full-name (getf statistics key)))
                       ((consp kind)
                        (unless refusals-written-p
                          (setf refusals-written-p t)
                          (write-refusals out statistics prefix)))
                       ((eq kind :by-class)
                        (write-metric-family out full-name 'counter help)
                        (loop for (class . count) in (getf statistics key)
                              do (format out "~A{class=\"~Dxx\"} ~D~%" full-name class count)))
                       ((member kind '(:by-code :by-protocol :by-cause))
                        (write-metric-family out full-name 'counter help)
                        (loop with label = (string-downcase (subseq (symbol-name kind) 3))
                              for (value . count) in (getf statistics key)
                              do (format out "~A{~A=\"~A\"} ~D~%" full-name label value count)))
                       ((eq kind :histogram-buckets)
                        (write-histogram out statistics full-name help)))))))
