;;;; The request of an HTTP/2 stream, answered by a worker: readiness/
;;;; (http2-turn.lisp) reads the connection's frames and hands each whole
;;;; request to a worker task, which calls ANSWER-HTTP2-REQUEST.
;;;;
;;;; Each stream is a Hunchentoot request: its head, rebuilt as HTTP/1.1,
;;;; parsed by the request cycle's parser, its protocol :HTTP/2.0, processed
;;;; by HUNCHENTOOT:PROCESS-REQUEST with the connection stream the stream's
;;;; HTTP2-REPLY-STREAM (readiness/http2-reply.lisp), so that every road a
;;;; reply takes (the engine's octets, Hunchentoot's START-OUTPUT,
;;;; SEND-HEADERS streams, static files) writes it as on HTTP/1.1, never
;;;; chunked (Hunchentoot chunks HTTP/1.1 only), and it leaves as HEADERS
;;;; and DATA as it is written.

(in-package #:hunchentoot-recycling-taskmaster)

(defun answer-http2-request (serving reply octets request-line-end head-end acceptor addresses)
  "Answer the HTTP/2 request in OCTETS -- an HTTP/1.1 head, its request
line's LF at REQUEST-LINE-END, ending at HEAD-END, then the body -- made on
ACCEPTOR for a connection with ADDRESSES, writing its reply to REPLY.  A
head the parser refuses is answered as on HTTP/1.1; 503 when the pool is
stopping.  :HELD when its handler deferred the reply, which is then sent
by whoever completes it; :OPEN when it made it an event stream, its head
sent."
  (let ((server-name (serving-server-header-value serving)))
    (flet ((refuse (status)
             (write-sequence (head-error-reply status server-name 1) reply)))
      (handler-case
          (let ((head (parse-request-head octets 0 request-line-end head-end
                                          (serving-name-scratch serving) (serving-request-head serving))))
            (setf (request-head-protocol head) :http/2.0)
            (let ((outcome (process-http2-request serving acceptor head addresses
                                                  (make-octets-input-stream octets :start head-end) reply)))
              (if outcome
                  (and (member outcome '(:held :open)) outcome)
                  (refuse 503))))
        (request-head-refused (condition)
          (refuse (refused-status condition)))))))

(defun process-http2-request (serving acceptor head addresses content-stream reply)
  "Process the request of HEAD, its body read from CONTENT-STREAM, as
ANSWER-REQUEST does, its reply written to REPLY.  False, nothing done,
when the pool is stopping; :HELD when its handler deferred the reply,
:OPEN when it made it an event stream; else true."
  (let ((taskmaster (engine-taskmaster (serving-engine serving)))
        (worker (serving-worker serving))
        (status nil))
    (unless (note-request-started taskmaster worker)
      (return-from process-http2-request nil))
    (unwind-protect
         (with-connection-bindings ()
           (with-request-bindings ()
             (setf (current-connection-stream) reply)
             (begin-request-state serving nil)
             (let* ((reply-object (make-reply (serving-constructors serving)
                                              (serving-plain-header-methods-p serving)))
                    (hunchentoot:*reply* reply-object)
                    (hunchentoot:*session* nil))
               (flet ((process-request ()
                        (hunchentoot:process-request
                         (make-request (serving-constructors serving) acceptor head addresses content-stream))))
                 (declare (dynamic-extent #'process-request))
                 (call-with-request-counted acceptor (serving-requests-in-progress-location serving)
                                            #'process-request))
               (setf status (hunchentoot:return-code reply-object)))))
      (note-request-finished taskmaster worker :answered (and status t)))
    (cond ((serving-deferred serving) :held)
          ((and (serving-event-stream serving) (eql status hunchentoot:+http-ok+)) :open)
          (t t))))

(defun answer-http2-frames (serving connection end)
  "The turn of CONNECTION, speaking HTTP/2 from now if it did not yet, END
octets of its frames starting the buffer (NIL: those it kept while
parked): HTTP2-TURN, its streams' requests answered by ANSWER-HTTP2-REQUEST."
  (let ((buffer (serving-buffer serving)))
    (http2-turn (serving-set serving) connection (serving-acceptor serving) buffer
                (or end (take-pending-bytes connection buffer (serving-budget serving)))
                #'answer-http2-request)))
