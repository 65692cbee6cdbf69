;;;; An access log entry as one JSON object a line, the convention of log
;;;; shippers (Vector, Fluent Bit, Loki's promtail, nginx's escape=json):
;;;; chosen by the acceptor's :ACCESS-LOG-FORMAT :JSON.

(in-package #:hunchentoot-recycling-taskmaster)

(defvar *json-log-time* (list 0 nil)
  "As *ACCESS-LOG-TIME*, for the ISO 8601 time in UTC.")

(defun json-log-time-octets ()
  "The octets of this second as ISO 8601 in UTC, 2026-12-07T21:05:09Z, late
by a tick of SBCL's coarse clock at most (ACCESS-LOG-TIME-OCTETS)."
  (let ((cache *json-log-time*)
        (now (get-internal-real-time)))
    (if (< now (first cache))
        (second cache)
        (multiple-value-bind (universal-time microseconds) (universal-time-and-microseconds)
          (multiple-value-bind (second minute hour date month year) (decode-universal-time universal-time 0)
            (let ((octets (string-utf-8-octets
                           (format nil "~4,'0D-~2,'0D-~2,'0DT~2,'0D:~2,'0D:~2,'0DZ"
                                   year month date hour minute second))))
              (setf *json-log-time*
                    (list (+ now (ceiling (* (- 1000000 microseconds) internal-time-units-per-second) 1000000))
                          octets))
              octets))))))

(defun push-json-string (string head)
  "Push STRING as a JSON string: quoted, its quote and backslash escaped, a
control character as \\u00HH, the rest as UTF-8."
  (declare (type simple-string string) (type reply-head head) (optimize speed))
  (push-octet 34 head)
  (let ((octets (room-for (* 6 (length string)) head))
        (position (reply-head-end head)))
    (declare (type fixnum position))
    (loop for char across string
          for code of-type (integer 0 #x10FFFF) = (character-utf-8-code char)
          do (cond ((log-control-char-p code)
                    ;; Six octets for one character: room was made for six.
                    (replace octets #.(map 'octets #'char-code "\\u00") :start1 position)
                    (setf (aref octets (+ position 4)) (char-code (char "0123456789abcdef" (ash code -4)))
                          (aref octets (+ position 5)) (char-code (char "0123456789abcdef" (logand code 15)))
                          position (+ position 6)))
                   ((or (= code 34) (= code 92))
                    (setf (aref octets position) 92
                          (aref octets (+ position 1)) code
                          position (+ position 2)))
                   (t (setf position (put-utf-8 code octets position)))))
    (setf (reply-head-end head) position))
  (push-octet 34 head))

(defun push-json-value (value head)
  "Push VALUE as JSON: NIL as null, a non-negative integer as its digits,
anything else as the string FORMAT's ~A writes (PUSH-LOG-VALUE)."
  (typecase value
    (null (push-log-ascii "null" head))
    ((integer 0) (push-decimal value head))
    (simple-string (push-json-string value head))
    (symbol (push-json-string (symbol-name value) head))
    (t (push-json-string (coerce (princ-to-string value) 'simple-string) head))))

(defun push-json-field (name value head)
  "Push a comma, \"NAME\": and VALUE (PUSH-JSON-VALUE)."
  (push-octet 44 head)
  (push-octet 34 head)
  (push-log-ascii name head)
  (push-log-ascii "\":" head)
  (push-json-value value head))

(defun push-access-log-json (head remote-addr forwarded-for user time-octets method script-name query-string
                             protocol return-code content-length microseconds referer user-agent)
  "Push the access log entry of a request as one JSON object and a newline:
the values of PUSH-ACCESS-LOG-LINE, null where that writes -, with the time
in UTC (JSON-LOG-TIME-OCTETS) and the request's duration in MICROSECONDS
(null when not known), as

  {\"time\":\"2026-12-07T21:05:09Z\",\"remote_addr\":\"127.0.0.1\",\"forwarded_for\":null,\"user\":null,
   \"method\":\"GET\",\"path\":\"/\",\"query\":null,\"protocol\":\"HTTP/1.1\",\"status\":200,
   \"octets\":4,\"duration_us\":85,\"referer\":null,\"user_agent\":\"curl/7.88.1\"}"
  (push-log-ascii "{\"time\":\"" head)
  (push-octets time-octets head)
  (push-octet 34 head)
  (push-json-field "remote_addr" remote-addr head)
  (push-json-field "forwarded_for" forwarded-for head)
  (push-json-field "user" user head)
  (push-json-field "method" method head)
  (push-json-field "path" script-name head)
  (push-json-field "query" query-string head)
  (push-json-field "protocol" protocol head)
  (push-json-field "status" return-code head)
  (push-json-field "octets" content-length head)
  (push-json-field "duration_us" microseconds head)
  (push-json-field "referer" referer head)
  (push-json-field "user_agent" user-agent head)
  (push-octet 125 head)
  (push-octet 10 head))
