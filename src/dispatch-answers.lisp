;;;; What is computed from the ACCEPTOR-DISPATCH-REQUEST methods that run
;;;; after one of ours -- the document root's chain, whether Hunchentoot's
;;;; easy-acceptor method is next -- kept in the acceptor until the generic
;;;; function's methods or the classes of acceptor and request change: asked
;;;; at every request, computed only then.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (dispatch-answer (:constructor make-dispatch-answer (methods-list acceptor-class request-class answer)))
  "What was computed from the ACCEPTOR-DISPATCH-REQUEST methods that run
after one of ours, for the generic function's methods as they were
(METHODS-LIST) and the classes of the acceptor and request."
  (methods-list nil :read-only t)
  (acceptor-class nil :read-only t)
  (request-class nil :read-only t)
  (answer nil :read-only t))

(defun current-dispatch-answer (kept acceptor request compute)
  "KEPT, a DISPATCH-ANSWER or NIL, while it is still true for ACCEPTOR and
REQUEST; else a new one, whose answer COMPUTE, a function of ACCEPTOR and
REQUEST, computes."
  (let ((methods-list (generic-function-methods-list #'hunchentoot:acceptor-dispatch-request)))
    (if (and kept
             (eq (dispatch-answer-methods-list kept) methods-list)
             (eq (dispatch-answer-acceptor-class kept) (class-of acceptor))
             (eq (dispatch-answer-request-class kept) (class-of request)))
        kept
        (make-dispatch-answer methods-list (class-of acceptor) (class-of request)
                              (funcall compute acceptor request)))))

(defmacro kept-dispatch-answer (place acceptor request compute)
  "The answer of the DISPATCH-ANSWER in PLACE (NIL at first) while it is
still true for ACCEPTOR and REQUEST, else of a new one, kept in PLACE (see
CURRENT-DISPATCH-ANSWER).  PLACE is written only when it changes: every
worker reads it at every request."
  (let ((kept (gensym "KEPT")) (current (gensym "CURRENT")))
    `(let* ((,kept ,place)
            (,current (current-dispatch-answer ,kept ,acceptor ,request ,compute)))
       (unless (eq ,current ,kept)
         (setf ,place ,current))
       (dispatch-answer-answer ,current))))
