;;;; The request of an HTTP/2 stream, answered by a worker: readiness/
;;;; (http2-connection.lisp) reads the connection's frames and hands each
;;;; whole request to a worker task, which calls ANSWER-HTTP2-REQUEST.
;;;;
;;;; Each stream is a Hunchentoot request: its head, rebuilt as HTTP/1.1,
;;;; parsed by the request cycle's parser, its protocol :HTTP/2.0, processed
;;;; by HUNCHENTOOT:PROCESS-REQUEST with the connection stream an in-memory
;;;; one, so that every road a reply takes (the engine's octets, Hunchentoot's
;;;; START-OUTPUT, SEND-HEADERS streams, static files) writes it as on
;;;; HTTP/1.1, never chunked (Hunchentoot chunks HTTP/1.1 only); its parts
;;;; are then read back (HTTP1-REPLY-PARTS) and sent as HEADERS and DATA.
;;;; A streamed reply leaves when its handler returns.

(in-package #:hunchentoot-recycling-taskmaster)

(defun answer-http2-request (serving octets request-line-end head-end acceptor addresses)
  "The reply to the HTTP/2 request in OCTETS -- an HTTP/1.1 head, its
request line's LF at REQUEST-LINE-END, ending at HEAD-END, then the body
-- made on ACCEPTOR for a connection with ADDRESSES: its status, headers
and body (HTTP1-REPLY-PARTS).  A head the parser refuses is answered as
on HTTP/1.1; 503 when the pool is stopping."
  (let ((server-name (serving-server-header-value serving)))
    (handler-case
        (let ((head (parse-request-head octets 0 request-line-end head-end
                                        (serving-name-scratch serving) (serving-request-head serving))))
          (setf (request-head-protocol head) :http/2.0)
          (http1-reply-parts
           (or (process-http2-request serving acceptor head addresses
                                      (make-octets-input-stream octets :start head-end))
               (head-error-reply 503 server-name 1))))
      (request-head-refused (condition)
        (http1-reply-parts (head-error-reply (refused-status condition) server-name 1))))))

(defun process-http2-request (serving acceptor head addresses content-stream)
  "Process the request of HEAD, its body read from CONTENT-STREAM, as
ANSWER-REQUEST does, its reply written to an in-memory stream: the reply
as HTTP/1.1 octets, or NIL when the pool is stopping."
  (let ((taskmaster (engine-taskmaster (serving-engine serving)))
        (worker (serving-worker serving))
        (output (make-octets-output-stream))
        (status nil))
    (unless (note-request-started taskmaster worker)
      (return-from process-http2-request nil))
    (unwind-protect
         (with-connection-bindings ()
           (with-request-bindings ()
             (setf (current-connection-stream) output
                   (serving-reply-connection serving) nil
                   (serving-reply-sent-p serving) nil
                   (serving-upgrade serving) nil
                   (serving-deferred serving) nil
                   (serving-event-stream serving) nil)
             (let* ((reply (make-reply (serving-constructors serving)
                                       (serving-plain-header-methods-p serving)))
                    (hunchentoot:*reply* reply)
                    (hunchentoot:*session* nil))
               (flet ((process-request ()
                        (hunchentoot:process-request
                         (make-request (serving-constructors serving) acceptor head addresses content-stream))))
                 (declare (dynamic-extent #'process-request))
                 (call-with-request-counted acceptor (serving-requests-in-progress-location serving)
                                            #'process-request))
               (setf status (hunchentoot:return-code reply))
               (finish-output (current-connection-stream)))))
      (note-request-finished taskmaster worker :answered (and status t)))
    (output-stream-octets output)))

(defun answer-http2-frames (serving connection end)
  "The turn of CONNECTION, speaking HTTP/2 from now if it did not yet, END
octets of its frames starting the buffer (NIL: those it kept while
parked): HTTP2-TURN, its streams' requests answered by ANSWER-HTTP2-REQUEST."
  (let ((buffer (serving-buffer serving)))
    (http2-turn (serving-set serving) connection (serving-acceptor serving) buffer
                (or end (take-pending-bytes connection buffer (serving-budget serving)))
                #'answer-http2-request)))
