;;;; PROMETHEUS-METRICS: the text exposition format, counters that only grow.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite metrics :in all :description "Statistics in Prometheus's text format.")
(in-suite metrics)

(defun parse-exposition (text)
  "The samples of TEXT, a hash table from name{labels} to value, and the
lines that are neither a # HELP or # TYPE comment nor a well-formed sample.
Second value: the families named by # TYPE lines."
  (let ((samples (make-hash-table :test #'equal))
        (families '())
        (bad '()))
    (dolist (line (uiop:split-string (string-right-trim '(#\Newline) text) :separator '(#\Newline)))
      (cond ((cl-ppcre:scan "^# HELP [a-zA-Z_:][a-zA-Z0-9_:]* \\S" line))
            ((cl-ppcre:register-groups-bind (name) ("^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram)$" line)
               (push name families)))
            ((multiple-value-bind (match groups)
                 (cl-ppcre:scan-to-strings "^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\\{[a-zA-Z_][a-zA-Z0-9_]*=\"[^\"]*\"(?:,[a-zA-Z_][a-zA-Z0-9_]*=\"[^\"]*\")*\\})?) (-?[0-9]+(?:\\.[0-9]+)?)$" line)
               (when match
                 (setf (gethash (aref groups 0) samples) (let ((*read-default-float-format* 'double-float))
                                                           (read-from-string (aref groups 1)))))))
            (t (push line bad))))
    (values samples families bad)))

(defun family-of (series)
  "The family a sample series belongs to: its name without labels and without
a histogram's _bucket, _sum or _count."
  (cl-ppcre:regex-replace "_(bucket|sum|count)$" (subseq series 0 (position #\{ series)) ""))

(test metrics.exposition-format-and-growing-counters
  (with-readiness-server (server)
    (flet ((scrape ()
             (multiple-value-bind (samples families bad) (parse-exposition (prometheus-metrics server))
               (is (null bad) "every line is a comment or a sample: ~S" bad)
               (loop for series being the hash-keys of samples
                     do (is (or (member (family-of series) families :test #'string=)
                                (member (subseq series 0 (or (position #\{ series) (length series)))
                                        families :test #'string=))
                            "~A has a # TYPE" series))
               samples)))
      (dotimes (i 5) (http-get server "/test/yo"))
      (http-get server "/test/no-such-page")
      (refused-with server (get-request "/test/yo" "No colon here"))
      ;; A request is counted just after its reply goes out.
      (is (wait-until (lambda () (<= 6 (gethash "hunchentoot_recycling_request_duration_seconds_count"
                                                (parse-exposition (prometheus-metrics server)) 0)))))
      (let ((before (scrape)))
        (is (<= 5 (gethash "hunchentoot_recycling_requests_served_total" before 0)))
        (is (<= 5 (gethash "hunchentoot_recycling_replies_total{class=\"2xx\"}" before 0)))
        (is (<= 2 (gethash "hunchentoot_recycling_replies_total{class=\"4xx\"}" before 0))
            "the 404 and the refused head")
        (is (= 1 (gethash "hunchentoot_recycling_refused_requests_total{status=\"400\"}" before 0)))
        (is (<= 6 (gethash "hunchentoot_recycling_request_duration_seconds_count" before 0)))
        (is (= (gethash "hunchentoot_recycling_request_duration_seconds_count" before)
               (gethash "hunchentoot_recycling_request_duration_seconds_bucket{le=\"+Inf\"}" before)))
        (is (<= (gethash "hunchentoot_recycling_request_duration_seconds_bucket{le=\"0.001\"}" before)
                (gethash "hunchentoot_recycling_request_duration_seconds_bucket{le=\"1\"}" before))
            "buckets are cumulative")
        (dotimes (i 5) (http-get server "/test/yo"))
        (is (wait-until (lambda () (<= 11 (gethash "hunchentoot_recycling_request_duration_seconds_count"
                                                   (parse-exposition (prometheus-metrics server)) 0)))))
        (let ((after (scrape)))
          (loop for series being the hash-keys of before using (hash-value value)
                when (or (search "_total" series) (search "_bucket" series) (search "_count" series)
                         (search "_sum" series))
                  do (is (<= value (gethash series after 0)) "~A went from ~A down to ~A"
                         series value (gethash series after)))
          (is (< (gethash "hunchentoot_recycling_requests_served_total" before)
                 (gethash "hunchentoot_recycling_requests_served_total" after))))))))

(test metrics.statistics-have-every-documented-key-and-no-other
  (with-readiness-server (server)
    (let ((keys (loop for (key) on (taskmaster-statistics server) by #'cddr collect key))
          (documented (mapcar #'first hunchentoot-recycling-taskmaster::*statistics-keys*)))
      (is (null (set-difference documented keys)) "missing: ~S" (set-difference documented keys))
      (is (null (set-difference keys documented)) "not in *STATISTICS-KEYS*: ~S" (set-difference keys documented))
      (is (= (length keys) (length (remove-duplicates keys))) "each key once"))))
