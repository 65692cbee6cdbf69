;;;; Mangled requests over the wire: whatever a client sends, it gets a
;;;; status line or a closed connection, and the server goes on serving with
;;;; no thread or connection left behind.  The inputs are well-formed requests
;;;; mutated by a seeded generator, so every run sends the same bytes.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite garbage-input :in all :description "Mangled requests never cost a worker.")
(in-suite garbage-input)

(defparameter *well-formed-requests*
  (list (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" "")
        (concatenate 'string
                     (crlf-lines "POST /test/params?a=1 HTTP/1.1" "Host: localhost"
                                 "Content-Type: application/x-www-form-urlencoded"
                                 "Content-Length: 7" "")
                     "b=2&c=3")
        (concatenate 'string
                     (crlf-lines "POST /test/body HTTP/1.1" "Host: localhost"
                                 "Transfer-Encoding: chunked" "")
                     (crlf-lines "3" "abc" "0" ""))
        (crlf-lines "GET /test/header?name=x-a HTTP/1.0" "X-A: b" "Connection: keep-alive" "")
        (crlf-lines "GET /test/chunked-reply HTTP/1.1" "Host: localhost" "Expect: 100-continue" ""))
  "The requests the garbage is made from.")

(defparameter *awkward-values*
  '("-1" "99999999999999999999999" "abc" "" "5, 6" "0x10" "chunked, gzip" "%zz" " "
    "HTTP/1.1" "GET / HTTP/1.1")
  "Values spliced into requests where a number, a token or a path belongs.")

(defparameter *awkward-octets* #(0 9 10 13 32 37 58 127 128 255)
  "NUL, TAB, LF, CR, space, %, colon, DEL and bytes that are not ASCII.")

(defun make-seeded-random (seed)
  "A function returning integers below its argument, repeatable from SEED
(xorshift64), so that a failing input can be sent again."
  (let ((state (logior 1 seed)))
    (lambda (below)
      (setf state (logxor state (ldb (byte 64 0) (ash state 13)))
            state (logxor state (ash state -7))
            state (logxor state (ldb (byte 64 0) (ash state 17))))
      (mod state below))))

(defun mutate (octets random)
  "OCTETS with one random mutation applied."
  (let* ((length (length octets))
         (position (funcall random (1+ length)))
         (end (min length (+ position 1 (funcall random 40)))))
    (flet ((splice (inserted &key (to position))
             ;; INSERTED replaces the octets from POSITION to TO.
             (concatenate '(vector (unsigned-byte 8))
                          (subseq octets 0 position) inserted (subseq octets to))))
      (ecase (funcall random 6)
        (0 (splice (vector (funcall random 256)) :to (min length (1+ position))))
        (1 (splice (vector (aref *awkward-octets* (funcall random (length *awkward-octets*))))))
        (2 (splice #() :to end))
        (3 (splice (subseq octets position end)))
        (4 (splice (flex:string-to-octets
                    (nth (funcall random (length *awkward-values*)) *awkward-values*)
                    :external-format :latin-1)
                   :to end))
        (5 (splice (flex:string-to-octets (crlf-lines "Content-Length: 3" "Transfer-Encoding: chunked")
                                          :external-format :latin-1)))))))

(defun garbage-inputs (count seed)
  "COUNT mangled requests, each with one to four mutations."
  (let ((random (make-seeded-random seed)))
    (loop repeat count
          collect (let ((octets (flex:string-to-octets
                                 (nth (funcall random (length *well-formed-requests*))
                                      *well-formed-requests*)
                                 :external-format :latin-1)))
                    (loop repeat (1+ (funcall random 4))
                          do (setf octets (mutate octets random)))
                    octets))))

(defun send-and-read-all (server octets seconds)
  "Send OCTETS on a new connection to SERVER and read until the server closes
it.  :CLOSED and what was read, or :STILL-OPEN after SECONDS."
  (let ((socket (connect server))
        (received (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t))
        (deadline (+ (get-internal-real-time) (* seconds internal-time-units-per-second))))
    (unwind-protect
         (let ((stream (usocket:socket-stream socket)))
           ;; The server may answer and close before it has read everything.
           (ignore-errors (write-sequence octets stream) (finish-output stream))
           (loop
             (when (> (get-internal-real-time) deadline)
               (return (values :still-open received)))
             (when (usocket:wait-for-input socket :timeout 0.1 :ready-only t)
               (let ((byte (ignore-errors (read-byte stream nil))))
                 (if byte
                     (vector-push-extend byte received)
                     (return (values :closed received)))))))
      (ignore-errors (usocket:socket-close socket)))))

(defun outcomes-of (server inputs &key (at-once 50) (seconds 5))
  "SEND-AND-READ-ALL of each of INPUTS, AT-ONCE at a time: a list of (ending
received) in the order of INPUTS."
  (loop for rest = inputs then (nthcdr at-once rest)
        while rest
        append (mapcar #'funcall
                       (loop for octets in rest
                             repeat at-once
                             collect (let ((octets octets))
                                       (in-thread (lambda () (send-and-read-all server octets seconds))))))))

(defun status-line-p (octets)
  "True when OCTETS begin with an HTTP/1.x status line."
  (and (>= (length octets) 13)
       (cl-ppcre:scan "^HTTP/1\\.[01] [1-5]\\d\\d "
                      (flex:octets-to-string octets :end 13 :external-format :latin-1))))

(test garbage.mangled-requests-never-cost-a-worker
  ;; 300 inputs, 50 at a time.  Every wait a mangled request can start ends
  ;; within a second (head, body read, keep-alive), so 5 s is a hang.
  (with-thread-leak-check ()
    (with-server (server (make-server 'parallel-easy-acceptor
                                      :read-timeout 1 :write-timeout 1
                                      :header-timeout 1 :keep-alive-timeout 1
                                      :taskmaster (make-instance 'recycling-taskmaster
                                                                 :standby-thread-count 2
                                                                 :max-thread-count 8)))
      (let ((outcomes (outcomes-of server (garbage-inputs 300 20261122))))
        (flet ((inputs-where (predicate)
                 (loop for (ending received) in outcomes
                       for index from 0
                       when (funcall predicate ending received) collect index)))
          (let ((left-open (inputs-where (lambda (ending received)
                                           (declare (ignore received))
                                           (not (eq :closed ending)))))
                (not-http (inputs-where (lambda (ending received)
                                          (declare (ignore ending))
                                          (not (or (zerop (length received)) (status-line-p received)))))))
            (is (null left-open) "inputs left open after 5 s: ~S" left-open)
            (is (null not-http) "inputs answered with something other than a status line: ~S" not-http)))
        (let ((answered (count-if (lambda (outcome) (status-line-p (second outcome))) outcomes)))
          (is (<= 100 answered) "most mangled requests get a status: ~D of 300 did" answered)))
      (is (eql 200 (http-get server "/test/yo")) "the server still serves")
      (is (wait-until (lambda () (zerop (stats server :busy-threads))))
          "no worker is left holding a connection")
      (is (wait-until (lambda () (zerop (stats server :open-connections)))) "no connection is left open"))))

(defun malformed-chunked-post (split-p)
  "A POST whose chunked body has a chunk-size line without a size; sent
with its head, or (SPLIT-P) its body after a pause."
  (let ((head (crlf-lines "POST /test/body HTTP/1.1" "Host: localhost" "Transfer-Encoding: chunked" ""))
        (body (crlf-lines "zz" "hello" "0" "")))
    (if split-p (list head body) (list (concatenate 'string head body)))))

(defun refused-status (server pieces)
  "The status SERVER answers the request sent as PIECES, a short pause
between them."
  (with-connection (socket server)
    (loop for (piece . more) on pieces
          do (send-text socket piece)
             (when more (sleep 0.01)))
    (read-response socket)))

(test garbage.malformed-chunked-bodies-cost-one-access-log-line-each
  ;; Each once wrote a 55 KB backtrace to the message log: a few thousand
  ;; small requests filled a disk.  A client's mistake is refused before
  ;; dispatch: one access-log line, counted, nothing in the message log.
  (uiop:with-temporary-file (:pathname access-log)
    (uiop:with-temporary-file (:pathname message-log)
      (with-server (server (make-server 'parallel-easy-acceptor :access-log-destination access-log
                                                                :message-log-destination message-log))
        (let ((before (stats server :bad-request-replies))
              (statuses (make-hash-table)))
          (dotimes (i 10000)
            (incf (gethash (refused-status server (malformed-chunked-post nil)) statuses 0)))
          (dotimes (i 100)
            (incf (gethash (refused-status server (malformed-chunked-post t)) statuses 0)))
          (let ((counts (loop for status being the hash-keys of statuses using (hash-value count)
                              collect (cons status count))))
            (is (equal '((400 . 10100)) counts) "every one answered 400: ~S" counts))
          (is (wait-until (lambda () (= (+ before 10100) (stats server :bad-request-replies)))))
          (is (eql 200 (http-get server "/test/yo")))))
      (let ((message-log-octets (with-open-file (in message-log) (file-length in)))
            (access-lines (with-open-file (in access-log)
                            (loop for line = (read-line in nil) while line count line))))
        (is (<= message-log-octets (* 2 1000 1000)) "the message log grew by ~:D octets" message-log-octets)
        (is (zerop message-log-octets) "nothing in the message log: ~:D octets" message-log-octets)
        (is (= 10101 access-lines) "one access-log line a request: ~D" access-lines)))))

(test garbage.credentials-that-are-not-base64-still-answered
  ;; Hunchentoot's access log entry decodes the Authorization header's Basic
  ;; credentials, which signals on these; the request went unanswered and its
  ;; kept-alive connection waited for the keep-alive timeout.
  (uiop:with-temporary-file (:pathname access-log)
    (uiop:with-temporary-file (:pathname message-log)
      (with-server (server (make-server 'parallel-easy-acceptor :access-log-destination access-log
                                                                :message-log-destination message-log))
        (with-connection (socket server)
          (dotimes (i 2)
            (send-text socket (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost"
                                          "Authorization: Basic !!!!" ""))
            (multiple-value-bind (status body) (read-response socket :timeout 5)
              (is (eql 200 status) "request ~D on the connection: ~S" (1+ i) status)
              (is (equal "Hey!" body)))))
        (is (eql 200 (http-get server "/test/yo"))))
      (is (eql 2 (log-lines-matching message-log "No access log entry for the 200 reply to 127.0.0.1"))
          "one message-log line for each entry not written")
      (is (eql 1 (log-lines-matching access-log "GET /test/yo")) "the request that could be logged was"))))
