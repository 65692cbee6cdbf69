;;;; The turn of a connection whose reply its handler deferred
;;;; (DEFER-REPLY): woken because the reply was completed, it sends the
;;;; reply as any other, with the handler's request, reply and session
;;;; bound again, then goes on with the requests the client sent meanwhile;
;;;; woken because the client hung up, it ends the connection.

(in-package #:hunchentoot-recycling-taskmaster)

(defun answer-completed-reply (serving connection request reply session status headers body deferred-at)
  "Send the reply to REQUEST that its handler deferred, with REPLY and
SESSION bound as in the handler, completed with STATUS, HEADERS and BODY,
on CONNECTION, and count it as answered since DEFERRED-AT.  What follows:
:NEXT, :CLOSE or :LET-GO."
  (let ((stream (connection-stream connection))
        (outcome :close))
    (with-request-bindings ()
      (setf (current-connection-stream) stream)
      ;; The worker's last request may have started an event stream, whose
      ;; head this reply would otherwise be sent as.
      (begin-request-state serving (and (plain-connection-p connection) connection))
      (unwind-protect
           (let ((hunchentoot:*request* request)
                 (hunchentoot:*reply* reply)
                 (hunchentoot:*session* session))
             (send-completed-reply request status headers body)
             (setf outcome (end-reply serving stream (hunchentoot:return-code reply))))
        (setf (serving-reply-connection serving) nil)))
    (note-answered-request (serving-set serving) connection (serving-counter-stripe serving)
                           (hunchentoot:return-code reply) (- (monotonic-microseconds) deferred-at))
    outcome))

(defun answer-deferred-reply (serving connection)
  "The turn of CONNECTION, whose reply is deferred, reported ready: the
reply completed is sent, then the requests that followed it are answered
(ANSWER-ARRIVED-REQUESTS); a client that hung up ends it (:CLOSE); else it
waits on (:DEFER)."
  (multiple-value-bind (state request reply session status headers body deferred-at)
      (settle-deferred-reply (serving-set serving) connection)
    (ecase state
      (:waiting (values :defer 0))
      (:gone :close)
      (:completed
       (let ((outcome (answer-completed-reply serving connection request reply session
                                              status headers body deferred-at)))
         (cond ((eq outcome :next)
                (follow-reply-rest-with connection :keep-alive)
                (answer-arrived-requests serving connection))
               ((follow-reply-rest-with connection :close) (values :send-rest 0))
               (t outcome)))))))
