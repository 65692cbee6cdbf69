;;;; The easy-routes part of the application server (bench/applications.lisp),
;;;; compiled and loaded by LOAD-EASY-ROUTES once easy-routes is: a route
;;;; with a parameter, and each acceptor mixed with easy-routes' acceptor as
;;;; its README has users do.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defclass parallel-routes-acceptor (easy-routes:easy-routes-acceptor hrt:parallel-easy-acceptor) ()
  (:documentation "Ours with easy-routes' routes, easy handlers where no route matches, as
EASY-ROUTES-ACCEPTOR is Hunchentoot's."))

(defun routes-acceptor-class (kind)
  "The acceptor class of the application server KIND with easy-routes."
  (ecase kind
    (:hunchentoot 'easy-routes:easy-routes-acceptor)
    (:parallel 'parallel-routes-acceptor)))

(easy-routes:defroute application-item ("/app/items/:id") ()
  (setf (ht:content-type*) "text/plain")
  (format nil "item ~A" id))
