;;;; TASKMASTER-STATISTICS in the Prometheus text exposition format, for a
;;;; monitoring system to scrape.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *metric-families*
  '((:threads "threads" gauge "Worker threads in the pool.")
    (:busy-threads "busy_threads" gauge "Workers not waiting for work.")
    (:accepting-threads "waiting_threads" gauge "Workers waiting for work.")
    (:in-request-threads "in_request_threads" gauge "Workers between a complete request head and its reply.")
    (:peak-threads "peak_threads" gauge "The most workers the pool has held at once.")
    (:parked-connections "parked_connections" gauge "Connections waiting for bytes without a thread.")
    (:open-connections "open_connections" gauge "Connections parked or being served.")
    (:unsent-replies "unsent_replies" gauge
     "Connections whose reply the socket has not taken whole, waiting for the client to read.")
    (:arriving-bodies "arriving_bodies" gauge "Requests whose body the engine is reading, before dispatch.")
    (:tls-handshakes "tls_handshakes" gauge "Connections whose TLS handshake the engine is taking.")
    (:requests-served "requests_served_total" counter "Requests answered through a handler.")
    (:threads-created "threads_created_total" counter "Worker threads made.")
    (:threads-retired "threads_retired_total" counter "Worker threads ended as surplus.")
    (:growth-declined "growth_declined_total" counter
     "Times the pool was asked to grow while the processors had no idle time, and did not.")
    (:connections-accepted "connections_accepted_total" counter "Connections accepted.")
    (:keep-alive-timeouts "keep_alive_timeouts_total" counter
     "Kept-alive connections closed at the keep-alive timeout.")
    (:write-timeouts "write_timeouts_total" counter
     "Connections closed because their client took none of its reply for the write timeout.")
    (:body-timeout-replies "body_timeout_replies_total" counter
     "Requests answered 408 because their body stalled for the read timeout.")
    (:handshake-timeouts "handshake_timeouts_total" counter
     "Connections closed because their TLS handshake was not done within the header timeout."))
  "Each scalar key of TASKMASTER-STATISTICS: its metric name (after the
prefix), its type and its help text.")

(defun write-metric-family (stream name type help)
  (format stream "# HELP ~A ~A~%# TYPE ~A ~(~A~)~%" name help name type))

(defun prometheus-metrics (acceptor &key (prefix "hunchentoot_recycling_"))
  "TASKMASTER-STATISTICS of ACCEPTOR (or of a RECYCLING-TASKMASTER) as a
string in the Prometheus text exposition format (version 0.0.4): each
family with # HELP and # TYPE, counters named ..._total, gauges, the
engine's replies by status class and refusals by status, and a histogram
of request durations (from the complete head to the flushed reply) with
its _bucket, _sum and _count.  Every name starts with PREFIX.  Serve it
with Content-Type text/plain; version=0.0.4.  Unspecified: the order of
the families."
  (let ((statistics (taskmaster-statistics acceptor)))
    (with-output-to-string (out)
      (loop for (key name type help) in *metric-families*
            for value = (getf statistics key)
            when value
              do (let ((full-name (concatenate 'string prefix name)))
                   (write-metric-family out full-name type help)
                   (format out "~A ~D~%" full-name value)))
      (let ((replies (getf statistics :replies-by-class)))
        (when replies
          (let ((name (concatenate 'string prefix "replies_total")))
            (write-metric-family out name 'counter "Replies by status class, refusals included.")
            (loop for (class . count) in replies
                  do (format out "~A{class=\"~Dxx\"} ~D~%" name class count)))))
      (when (getf statistics :connections-accepted)
        (let ((name (concatenate 'string prefix "refused_requests_total")))
          (write-metric-family out name 'counter
                               "Requests the engine answered by itself, without a handler, by status.")
          (loop for (status key) in *head-refusals*
                do (format out "~A{status=\"~D\"} ~D~%" name status (getf statistics key 0)))))
      (let ((buckets (getf statistics :request-duration-buckets)))
        (when buckets
          (let ((name (concatenate 'string prefix "request_duration_seconds")))
            (write-metric-family out name 'histogram
                                 "Requests answered through a handler, by seconds from the complete head to the flushed reply.")
            (loop for (bound . count) in buckets
                  do (format out "~A_bucket{le=\"~A\"} ~D~%" name (metric-number bound) count))
            (format out "~A_bucket{le=\"+Inf\"} ~D~%~A_sum ~A~%~A_count ~D~%"
                    name (getf statistics :request-duration-count)
                    name (metric-number (getf statistics :request-duration-seconds))
                    name (getf statistics :request-duration-count))))))))

(defun metric-number (number)
  "NUMBER as Prometheus reads a sample value: decimal, no exponent marker."
  (if (integerp number)
      (princ-to-string number)
      (let ((*read-default-float-format* 'double-float))
        (string-right-trim "." (string-right-trim "0" (format nil "~,6F" number))))))
